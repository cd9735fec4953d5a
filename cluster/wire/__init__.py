"""What crosses the network: the OpenAI and Anthropic wire schemas, our internal request
and chunk types and the one Backend interface, the OpenAI response shapes and the SSE writer,
the engine's token stream, the Messages and Responses APIs, typed errors. Pure."""
