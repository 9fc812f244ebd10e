"""The front door: gRPC and OpenAI-compatible HTTP over one RouterCore, with validation, harmony
rendering and parsing, stop strings, auth, rate limits, health and metrics. It talks to any engine through
`engine_client.EngineClient` and imports no worker and nothing of cluster/.
"""
