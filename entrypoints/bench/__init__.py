"""`replayllm bench`: throughput and latency benchmarks on the workloads of docs/benchmarks.md."""
