"""What crosses the network: the OpenAI and Anthropic wire schemas, our internal request
and chunk types, the one stream seam every backend plugs into on the gateway's side
(``stream.py``), an engine replica's in-process engine (``backend.py``), the OpenAI response shapes
and the SSE writer, the engine's token stream, the Messages and Responses APIs, typed errors. Pure."""
