"""tools/gpu_kit.py: what it cuts into calls comes back whole, and a missing or damaged part is named."""
import importlib.util
import os
import re

import pytest

from tools import gpu_kit
from tools.gpu_kit import KitError, pack, plan_parts, unpack


def test_the_commands_the_kit_names_exist():
    """The kit's usage names the commands to run on the device (the GPU check, the proposers'
    table): each is a module that can be found from the repository's root."""
    modules = re.findall(r"python -m ([\w.]+)", gpu_kit.__doc__)
    assert "benchmarks.gpu_check" in modules and "benchmarks.proposers" in modules
    assert all(importlib.util.find_spec(m) is not None for m in modules), modules


@pytest.fixture
def files(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    contents = {"model.gguf": os.urandom(2500), "eagle/config.json": b"{}", "empty": b"",
                "wheels/a.whl": os.urandom(700)}
    out = []
    for name, data in contents.items():
        path = src / name.replace("/", "_")
        path.write_bytes(data)
        out.append((name, str(path)))
    return out, contents


def test_the_calls_hold_every_byte_within_the_budget_and_join_back(tmp_path, files):
    files, contents = files
    kit = tmp_path / "kit"
    manifest = pack(files, str(kit), budget=1000)
    calls = sorted(os.listdir(kit))
    assert calls == ["call1", "call2", "call3", "call4"]   # 3,202 bytes at 1,000 a call
    for call in calls:
        parts = [f for f in os.listdir(kit / call) if f.endswith(".part")]
        assert sum(os.path.getsize(kit / call / f) for f in parts) <= 1000
        assert (kit / call / "manifest.json").is_file()   # whichever calls arrive, the manifest is there
    assert len(manifest["parts"]) == 7   # the model in 3, the wheel across a call's end in 2
    out = unpack(str(kit), install=False)
    assert {name: open(path, "rb").read() for name, path in out.items()} == contents


def test_parts_fill_each_call_in_order(tmp_path):
    for name, size in (("a", 250), ("b", 100)):
        (tmp_path / name).write_bytes(bytes(size))
    calls = plan_parts([(n, str(tmp_path / n)) for n in "ab"], 200)
    assert [[(p["name"], p["offset"], p["size"]) for p in call] for call in calls] == [
        [("a", 0, 200)], [("a", 200, 50), ("b", 0, 100)]]


@pytest.mark.parametrize("damage", ["missing", "changed"])
def test_a_part_that_did_not_arrive_whole_is_named_with_its_call(tmp_path, files, damage):
    kit = tmp_path / "kit"
    pack(files[0], str(kit), budget=1000)
    part = kit / "call2" / sorted(f for f in os.listdir(kit / "call2") if f.endswith(".part"))[0]
    if damage == "missing":
        part.unlink()
    else:
        part.write_bytes(b"x" + part.read_bytes()[1:])
    with pytest.raises(KitError, match="call2"):
        unpack(str(kit), install=False)


def test_every_call_that_did_not_arrive_is_named_and_packs_are_not_mixed(tmp_path, files):
    kit = tmp_path / "kit"
    pack(files[0], str(kit), budget=1000)
    for call in ("call1", "call3"):
        for f in os.listdir(kit / call):
            if f.endswith(".part"):
                (kit / call / f).unlink()
    with pytest.raises(KitError, match=r"\.gpu_kit/call1, \.gpu_kit/call3 are not here"):
        unpack(str(kit), install=False)
    other = tmp_path / "other"
    pack(files[0][:1], str(other), budget=1000)   # another pack's call folder left beside this one's
    os.rename(other / "call1", kit / "call5")
    with pytest.raises(KitError, match="different packs"):
        unpack(str(kit), install=False)


def test_an_empty_file_after_a_full_call_opens_no_call(tmp_path):
    (tmp_path / "a").write_bytes(bytes(200))
    (tmp_path / "b").write_bytes(b"")
    calls = plan_parts([(n, str(tmp_path / n)) for n in "ab"], 200)
    assert [[(p["name"], p["size"]) for p in call] for call in calls] == [[("a", 200), ("b", 0)]]


def test_no_kit_here_says_what_to_carry(tmp_path):
    with pytest.raises(KitError, match="carry the kit's call folders"):
        unpack(str(tmp_path / "nothing"), install=False)
