"""The C kernels' sources: the rows Python hands them match the structs they read, every build
is keyed by every header it includes, and no source includes another source."""

import re
from pathlib import Path

from loraserve.lora import sgmv_cpu
from loraserve.ops import cbuild

PKG = Path(cbuild.__file__).resolve().parents[1]


def _struct_fields(header: str, name: str) -> tuple[str, ...]:
    body = re.search(r"typedef struct \{([^}]*)\}\s*" + name + ";", header).group(1)
    return tuple(f.strip() for f in body.split(";")[0].replace("int64_t", "").split(","))


def test_rows_match_the_structs_the_kernels_read():
    header = (PKG / "lora" / "lora_rows.h").read_text()
    assert _struct_fields(header, "lora_seg") == sgmv_cpu.SEG_FIELDS
    assert _struct_fields(header, "lora_part") == sgmv_cpu.PART_FIELDS


def test_no_source_includes_another_source():
    for src in PKG.rglob("*.[ch]"):
        for inc in re.findall(r'^\s*#\s*include "([^"]+)"', src.read_text(), re.MULTILINE):
            assert inc.endswith(".h"), f"{src.relative_to(PKG)} includes {inc}"
            assert (src.parent / inc).is_file(), f"{src.relative_to(PKG)}: {inc} not found"


def test_build_key_covers_nested_headers_once(tmp_path):
    (tmp_path / "inc").mkdir()
    (tmp_path / "k.c").write_text('#include "inc/a.h"\n#include "inc/b.h"\nint k;\n')
    (tmp_path / "inc" / "a.h").write_text('#include "b.h"\nint a;\n')
    (tmp_path / "inc" / "b.h").write_text('  #  include "a.h"\nint b;\n')  # a cycle
    texts = cbuild._source_texts(tmp_path / "k.c")
    assert sorted(texts) == sorted(p.read_text() for p in
                                   (tmp_path / "k.c", tmp_path / "inc/a.h", tmp_path / "inc/b.h"))
