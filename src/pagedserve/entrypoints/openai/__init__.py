"""The OpenAI-compatible HTTP gateway (`pagedserve openai`): api_server (FastAPI app and command
line), serving (requests to gRPC and back), protocol (pydantic bodies), schedulers (round robin
over the public gRPC API), metrics (Prometheus)."""
