"""Tool calls and rewards as rq jobs: the registries loaded from ``module:function`` specs (tools, rewards),
their jobs (tool_jobs) and the rq worker that runs them (tools_worker)."""
