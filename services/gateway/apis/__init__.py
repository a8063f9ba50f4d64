"""The APIs a stock SDK speaks besides chat completions, each translated to the gateway's chat calls and back.

One module an API: it parses the API's request (pydantic, strict, each problem a 400 naming the field in the
API's own error shape), renders it as OpenAI chat messages and tools, asks ``Gateway.chat_calls`` for the calls
(so exact ids, forks, retries and crash recovery are the chat path's), and writes the answer, whole or streamed,
in the API's own form from the finished call.
"""
