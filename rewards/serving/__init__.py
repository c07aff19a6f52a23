"""Running rewards, apart from the reward models themselves: scoring in background threads and over HTTP.

- `executor`: `RewardExecutor`, a thread pool that scores while the trainer samples the next batch;
- `wire`: the HTTP protocol (JSON, image encodings), shared by the client and the server;
- `http`: the client, the `http` reward (`HttpReward`): retries, waiting for the server, one-line errors;
- `server`: `flowrl serve-reward`: one reward-model copy serving many trainers, requests batched together
  (`serve_reward`, `RewardServer`); `server_app` is its FastAPI application and `server_requests` what it accepts
  (request parsing, size and memory limits, address checks).
"""
