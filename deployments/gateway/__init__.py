"""The gateway: the HTTP ingress deployment, a request's way from its bytes to its backend's stream
(prepare, attempts, relay, migration), the APIs' shapes, and the gateway's side of the engines (the
replica picker and its HTTP client, Serve's router shim that runs in this process, the KV-event feed)."""
