"""An engine replica: the Serve deployment around one engine (vLLM or the simulator), its token-stream
server, warm-up, KV-cache events, and the host-level knobs vLLM needs on a CPU (the AMX tile state)."""
