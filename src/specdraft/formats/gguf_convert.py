"""llama.cpp's own converter (convert_hf_to_gguf.py), run in its environment by
formats/gguf_export.py:

    ENGINE_PYTHON formats/gguf_convert.py LLAMA_CPP_SOURCE [the converter's arguments]

It imports nothing of specdraft. One thing is added to what the converter does: a byte-level BPE
tokenizer that its table of known tokenizers does not list (the converter recognises a tokenizer
by the hash of its output on a test string, so any newly trained vocabulary is unknown, such as
the demo target's) is written with llama.cpp's `gpt-2` pre-tokenizer when its tokenizer.json
declares exactly GPT-2's splitting (a ByteLevel pre-tokenizer with its regex and no prefix
space, and no normalizer), which is what that name runs; it says so on stdout, which the
exporter logs. Any other unknown tokenizer stays the converter's error.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path


def gpt2_splitting(folder: Path) -> bool:
    try:
        tokenizer = json.loads((folder / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return False
    pre = tokenizer.get("pre_tokenizer") or {}
    if (tokenizer.get("normalizer") or None) is not None:
        return False  # llama.cpp's gpt-2 splitting normalizes nothing
    if pre.get("type") == "Sequence" and len(pre.get("pretokenizers", [])) == 1:
        pre = pre["pretokenizers"][0]
    return (
        pre.get("type") == "ByteLevel"
        and pre.get("use_regex", True)
        and not pre.get("add_prefix_space", False)
    )


def main() -> None:
    source = Path(sys.argv[1])
    sys.path.insert(0, str(source))
    sys.path.insert(0, str(source / "gguf-py"))
    from conversion import base

    known = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            if gpt2_splitting(Path(self.dir_model)):
                print(
                    "[gguf] the converter does not know this byte-level BPE; its tokenizer.json "
                    "splits as GPT-2's does: written with llama.cpp's gpt-2 pre-tokenizer",
                    flush=True,
                )
                return "gpt-2"
            raise

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = [str(source / "convert_hf_to_gguf.py"), *sys.argv[2:]]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
