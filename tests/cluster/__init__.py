"""The cluster harness: sidecars, trainers and an S3 endpoint joined by fault proxies."""
