"""The OpenAI-compatible door of a rollout server (docs/AGENTS.md): ``app`` (routes, auth, errors), ``sessions``
(HTTP chat sessions as token-exact episodes), ``tool_calls`` (the model's calls read from its text), ``schemas``
(request bodies), ``responses`` (OpenAI-shaped bodies and SSE), ``serve`` (uvicorn on the server's loop)."""
