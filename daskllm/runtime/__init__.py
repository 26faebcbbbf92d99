"""The runtime on the client: one entry that plans and submits (:mod:`~daskllm.runtime.submit`),
the collection users hold (:mod:`~daskllm.runtime.collection`), the cluster view taken per
submission (:mod:`~daskllm.runtime.view`), usage metering and cluster-wide controls."""
