"""Traffic control in front of the pipeline: admission (a concurrency cap with a priority queue),
per-key rate limits (local or shared through Redis), and the graceful drain on SIGTERM. All of it is
applied by one pure ASGI middleware (`traffic.middleware`), outside the pipeline."""
