"""The configuration reference documents every setting there is."""

from __future__ import annotations

import pathlib

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _keys(tree: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else key
        out += _keys(value, name) if isinstance(value, dict) else [name]
    return out


def test_every_config_key_is_in_the_reference():
    defaults = yaml.safe_load((ROOT / "daskllm" / "daskllm.yaml").read_text())
    reference = (ROOT / "docs" / "configuration.md").read_text()
    missing = [k for k in _keys(defaults) if f"`{k}`" not in reference]
    assert not missing, f"undocumented settings: {missing}"
    assert len(_keys(defaults)) > 20


def test_docs_link_to_files_that_exist():
    import re

    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#:]+\.md)\)", doc.read_text()):
            assert (doc.parent / target).is_file(), f"{doc.name} links to missing {target}"
