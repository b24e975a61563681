"""The OpenAI-compatible surface: the app (api_server.py), request/response models, one serving class per endpoint,
streaming, tool calling and the OpenAPI document."""
