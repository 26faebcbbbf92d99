"""Python loads this at start in the docs examples tests/test_docs.py runs on its shared cluster
(this folder is first on their PYTHONPATH): see docs_cluster.py."""

import os

if os.environ.get("DASKLLM_DOCS_CLUSTER"):
    import docs_cluster

    docs_cluster.install()
