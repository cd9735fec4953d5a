"""Request policy, pure and synchronous: admission (queues, deadlines, the 429 Retry-After
estimate, tenants, the SLO guard), the context window, which backends honour a request's
fields, the first-token race with its hedging and failover, mid-stream migration."""
