"""SGLang's own surface, served with `--engine-type sglang`: its native routes and `sglang:` metrics."""
