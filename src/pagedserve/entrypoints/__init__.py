"""The entry points users know from vLLM: the offline `LLM` API (llm.py, sampling_params.py,
outputs.py over the in-process path of inprocess.py) and the OpenAI-compatible HTTP gateway
(openai/, in front of schedulers over the public gRPC API)."""
