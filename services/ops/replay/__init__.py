"""`streamrl replay`: a text episode decoded and continued (text), an agent episode run again against its
own log (agent)."""
