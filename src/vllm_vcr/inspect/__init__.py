"""Looking at traces and making them from other tools' reports: `vllm-vcr inspect` (summarize,
plot, perfetto, calibrate, from-aiperf, from-guidellm, gen-demo)."""
