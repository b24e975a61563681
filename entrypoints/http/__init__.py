"""HTTP plumbing under the OpenAI routes: request and body limits, connection caps, the uvicorn protocol, error
bodies, middlewares (auth, request log, metrics)."""
