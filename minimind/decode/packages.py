"""Compiled decode steps kept on disk between starts: AOTInductor packages (`torch._inductor.aoti_compile_and_package`,
as torchchat ships its models), one file per step, in a cache directory (`default_cache_dir()`).

Why AOTInductor and not inductor's own caches: a frozen step's graph holds oneDNN-packed weights, which inductor's
FX-graph cache cannot pickle, and its C++ wrapper names each constant by an identity hash that changes between
processes, so with `torch.compile` every start traces, lowers and builds the step again. An AOTInductor package is
the whole compiled step, its frozen (prepacked) weights included: a later start loads it and decodes without tracing
or compiling anything. A one-row step (the chat commands') keeps its weights as files beside its shared library
(`WEIGHTS_APART`), read once into the memory the step runs from; inside the library, the runtime copies them out at
every load, and for a while both copies are resident (`load_package`).

A package is only valid for exactly what it was built from, so its entry is named by a digest of all of it
(`entry_material`): the weights and buffers themselves, the config (not the directory it was loaded from), the source
of the model and of this package, the step's input shapes and strides (batch, cache length), inductor's settings,
torch's, transformers' and Python's versions, the CPU (torch's capability level, maker, model and feature flags, the
ISA overrides torch and oneDNN read) and the number of threads (inductor's C++ GEMM template blocks its loops for it).
Beside each package a JSON file holds that material with the package's size and SHA-256: an entry whose material
differs (a digest collision, a copied file) or whose package does not match its checksum (a truncated or damaged file)
is deleted and built again, never loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import platform
import shutil
import tempfile
import threading
import time
import zipfile
from pathlib import Path

import torch

from minimind.decode.memory import MADV_PAGEOUT, huge_page_bytes, into_huge_pages, madvise
from minimind.errors import InputError
from minimind.hardware import cpu_caps, cpuinfo
from minimind.heap import trim_heap

FORMAT = 2  # bump when what a package holds or how it is called changes
DEFAULT_MAX_GB = 4.0  # a package holds its model's weights: room for a few models' steps (env var overrides)
STRAY_SECONDS = 24 * 3600  # a half-written file this old belongs to a build that was stopped, not a running one
_LOADING = threading.Lock()
_MALLOC_OFFSET = 16  # bytes: where glibc's malloc starts a block it maps (its header before it)
_ALIGN = 64  # bytes: where each weight starts in the block the archive's weights are read into, as in the runtime's
_SOURCES = (
    "compiled.py",
    "attention.py",
    "fp32_products.py",
    "sixteen_bit_products.py",
    "graph_edits.py",
    "fbgemm.py",
    "rows.py",
    "packages.py",
)


# AOTInductor's settings for a package whose weights are files of their own in the archive (torch.save'd, listed in
# weights_config.json) instead of data inside its shared library. Only plain tensors can be written so.
WEIGHTS_APART = {
    "aot_inductor.package_constants_in_so": False,
    "aot_inductor.package_constants_on_disk_format": "pickle_weights",
}


def load_package(path, own: dict[str, torch.Tensor] | None = None):
    """The package's runner, its weights in memory once, and the files it was unpacked into deleted
    (`_remove_extracted`).

    Weights apart from the library (`WEIGHTS_APART`) are handed to the runtime, which uses them without copying:
    those the step took over unchanged from the model (the embedding, the norms) as the tensors in `own` (by the
    package's names for them: "model." and the state-dict name), the others read one by one from the archive.
    Weights inside the library are copied by the runtime out of the library's mapping into memory it owns; the
    mapped copy is never read again, yet stays resident (as large as the weights themselves), so the
    non-executable mappings the load added are paged out (`madvise(MADV_PAGEOUT)`: clean file pages, dropped, read
    back from the file should anything touch them). Where that is unavailable (not Linux, a kernel before 5.4),
    nothing changes but the memory. The runtime's copy is then moved into huge pages (`into_huge_pages`), as the
    weights apart are read into them: a step reads all of them at every token. Loads take turns: each tells its
    own mappings by what it added."""
    with _LOADING:
        trim_heap()  # memory freed before the load goes back first, so that it does not add to the load's peak
        before, memory = _mapped_files(), _anonymous_mappings()
        with _no_isa_probes():
            runner = torch._inductor.aoti_load_package(str(path))
        weights = _weights_apart(path, own or {})
        if weights:
            runner.load_constants(weights, check_full_update=True, user_managed=True)
            del weights
            trim_heap()  # the archive's read buffers, freed into the heap, go back to the system
        else:  # the runtime's copy of the weights, out of the library: the new memory written throughout
            for start, end in _anonymous_mappings() - memory:
                into_huge_pages(start, end)
        added = _mapped_files() - before
    _page_out([m for m in added if "x" not in m[2]])
    _remove_extracted({Path(m[3]) for m in added})
    return runner


@contextlib.contextmanager
def _no_isa_probes():
    """Loading a package compares the CPU's vector ISA with the one the package was built for, only to log a warning;
    telling the ISA builds and loads a test library per candidate in a Python subprocess each, most of the load's
    time. A package's entry is keyed by the CPU's features already (`cpu_material`), so the load takes the ISAs the
    CPU's flags name as given, and what inductor learnt so is forgotten after it (a step compiled later in the
    process checks its ISAs, as where nothing was loaded)."""
    from torch._inductor import cpu_vec_isa

    listing = getattr(cpu_vec_isa, "valid_vec_isa_list", None)
    told = not hasattr(listing, "cache_clear") or listing.cache_info().currsize > 0
    try:
        with torch._inductor.config.patch({"cpp.vec_isa_ok": True}):
            yield
    finally:
        if not told:
            forget_isa_checks()


def forget_isa_checks() -> None:
    """Inductor's answers on which vector ISAs this CPU and compiler can use, cleared: its list of them, and each
    ISA's own check of the extra features it needs (kept per ISA object for the process)."""
    from torch._inductor import cpu_vec_isa

    for cached in (
        getattr(cpu_vec_isa, "valid_vec_isa_list", None),
        *(vars(type(isa)).get("__bool__") for isa in getattr(cpu_vec_isa, "supported_vec_isa_list", ())),
    ):
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()


def _weights_apart(path, own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The package's weights kept apart from its library ({} when they are inside it), by the names the runtime
    knows them by: the tensor in `own` where it has the recorded shape and strides, else the archive's.

    The archive's weights are read straight into one block of memory, one after the other, laid out as the runtime
    lays out the weights it copies out of a library: each 64-byte aligned from the block's start, which lies 16
    bytes past a page, where glibc's `malloc` puts a large block. Steps over the same fp32 weights in separate
    allocations, or in one block starting on a page, decoded slower. The block is asked for huge pages
    (`huge_page_bytes`): a step reads all of it at every token, and decoded faster from huge pages than from small
    ones (docs/performance.md, "Fast decode on a CPU")."""
    try:
        archive = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile):
        return {}
    with archive, open(path, "rb") as raw:
        config = next((name for name in archive.namelist() if name.endswith("/weights_config.json")), None)
        if config is None:
            return {}
        folder = config.split("/data/aotinductor/")[0] + "/data/weights/"
        recorded = json.loads(archive.read(config))
        taken = {name for name, (_, shape, stride, _) in recorded.items() if _has_layout(own.get(name), shape, stride)}
        files = list(dict.fromkeys(file for name, (file, *_) in recorded.items() if name not in taken))
        storages, dtypes = {}, {}
        for file in files:
            saved = _record(raw, archive, folder + file)  # one tensor as torch.save writes it: a zip archive itself
            dtypes[file] = torch.load(saved, map_location="meta", weights_only=True).dtype
            with zipfile.ZipFile(saved) as weight:
                [storage] = [info.filename for info in weight.infolist() if info.filename.split("/")[-2] == "data"]
                storages[file] = _record(saved, weight, storage)
        offsets, total = {}, 0
        for file in files:
            offsets[file] = total
            total += -(-storages[file].size // _ALIGN) * _ALIGN
        trim_heap()  # torch.load's buffers go back before the block is allocated
        block = huge_page_bytes(total, _MALLOC_OFFSET)
        for file in files:
            _read_into(storages[file], block[offsets[file] : offsets[file] + storages[file].size])
        weights = {}
        for name, (file, shape, stride, offset) in recorded.items():
            if name in taken:
                weights[name] = own[name]
            else:
                dtype = dtypes[file]
                start = (block.storage_offset() + offsets[file]) // dtype.itemsize + offset
                weights[name] = block.view(dtype).as_strided(shape, stride, start)
    return weights


class _Record(io.RawIOBase):
    """A record an archive stores uncompressed, as a seekable file of its own over the archive's open file. Zipfile's
    own reader of a record goes back to the record's start at every seek backwards, which made reading a package's
    weights (zip archives inside the zip archive, read by seeking to their directories) take seconds."""

    def __init__(self, file, start: int, size: int):
        super().__init__()
        self.file, self.start, self.size, self.position = file, start, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence]
        self.position = max(0, base + offset)
        return self.position

    def readinto(self, buffer) -> int:
        wanted = max(0, min(len(buffer), self.size - self.position))
        self.file.seek(self.start + self.position)
        count = self.file.readinto(memoryview(buffer).cast("B")[:wanted])
        self.position += count
        return count


def _record(file, archive: zipfile.ZipFile, name: str):
    """The record `name` of `archive` (whose bytes `file` reads): read in place where it is stored uncompressed (as
    AOTInductor and torch.save store them), else read whole into memory first."""
    info = archive.getinfo(name)
    if info.compress_type != zipfile.ZIP_STORED:
        return _Record(io.BytesIO(archive.read(info)), 0, info.file_size)
    file.seek(info.header_offset)
    header = file.read(30)  # a local file header, the name and an extra field of its own after it
    if header[:4] != b"PK\x03\x04":
        raise zipfile.BadZipFile(f"no local header for {name}")
    names, extra = int.from_bytes(header[26:28], "little"), int.from_bytes(header[28:30], "little")
    return _Record(file, info.header_offset + 30 + names + extra, info.file_size)


def _has_layout(tensor, shape, stride) -> bool:
    return tensor is not None and (list(tensor.shape), list(tensor.stride())) == (shape, stride)


def _read_into(file, destination: torch.Tensor, chunk: int = 1 << 20) -> None:
    """Reads `file` into the bytes of `destination` a chunk at a time, never holding more than a chunk in between."""
    view = memoryview(destination.numpy())
    for start in range(0, len(view), chunk):
        wanted = min(chunk, len(view) - start)
        if file.readinto(view[start : start + wanted]) != wanted:
            raise ValueError(f"a weight's record ends within its {len(view)} bytes")


# Kernel files a GPU package's runtime opens when it first launches them, after the load: where any is present the
# extracted files must stay.
_LAZILY_READ = (".cubin", ".fatbin", ".ptx", ".hsaco", ".spv")


def _remove_extracted(libraries: set[Path]) -> None:
    """Deletes the directories the runtime extracted `libraries` into.

    The runtime unpacks a package into a fresh `aotinductor_*` directory under the temporary directory at every
    load and deletes it only when the loaded package is destroyed: a process killed or stopped before then (the
    out-of-memory killer, SIGKILL) leaves the whole package behind, as large as its weights, at every start. A CPU
    package has nothing left to read from those files once loaded (the library stays mapped, and Linux keeps a
    mapped file's pages after its name is gone), so the directory goes at once."""
    for library in libraries:
        extracted = next((p for p in library.parents if p.name.startswith("aotinductor_")), None)
        if extracted is None or not extracted.is_dir():
            continue
        if any(file.suffix in _LAZILY_READ for file in extracted.rglob("*")):
            continue
        shutil.rmtree(extracted, ignore_errors=True)


def _mapped_files() -> set[tuple[int, int, str, str]]:
    """(start, end, permissions, path) of this process' file mappings of shared libraries."""
    return {mapping for mapping in _mappings() if mapping[3].endswith(".so")}


def _anonymous_mappings() -> set[tuple[int, int]]:
    """(start, end) of this process' private anonymous mappings that can be read and written (large blocks from
    `malloc`, among others)."""
    return {(start, end) for start, end, mode, path in _mappings() if not path and mode[:2] == "rw" and mode[3] == "p"}


def _mappings() -> list[tuple[int, int, str, str]]:
    """(start, end, permissions, path or "") of this process' mappings (/proc/self/maps; none where it is missing)."""
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.read().splitlines()
    except OSError:
        return []
    mappings = []
    for line in lines:
        fields = line.split(maxsplit=5)
        start, end = (int(address, 16) for address in fields[0].split("-"))
        mappings.append((start, end, fields[1], fields[5] if len(fields) == 6 else ""))
    return mappings


def _page_out(mappings) -> None:
    for start, end, _, _ in mappings:
        madvise(start, end - start, MADV_PAGEOUT)  # an older kernel's EINVAL changes nothing


def default_cache_dir() -> Path:
    """$MINIMIND_COMPILE_CACHE, else $MINIMIND_CACHE/compiled (beside the data cache), else
    $XDG_CACHE_HOME/minimind/compiled (~/.cache/minimind/compiled)."""
    if os.environ.get("MINIMIND_COMPILE_CACHE"):
        return Path(os.environ["MINIMIND_COMPILE_CACHE"]).expanduser()
    if os.environ.get("MINIMIND_CACHE"):
        return Path(os.environ["MINIMIND_CACHE"]).expanduser() / "compiled"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "minimind" / "compiled"


def default_max_bytes() -> int:
    """$MINIMIND_COMPILE_CACHE_MAX_GB (a number of GB, 0: keep only the newest entry) or `DEFAULT_MAX_GB`."""
    value = os.environ.get("MINIMIND_COMPILE_CACHE_MAX_GB", "").strip()
    try:
        gigabytes = float(value) if value else DEFAULT_MAX_GB
    except ValueError:
        raise InputError(f"MINIMIND_COMPILE_CACHE_MAX_GB={value!r} is not a number of GB; use e.g. 4") from None
    if gigabytes < 0:
        raise InputError(f"MINIMIND_COMPILE_CACHE_MAX_GB={value!r} is negative; use e.g. 4, or 0")
    return int(gigabytes * 1e9)


def cpu_material() -> dict:
    """What the compiled kernels depend on in the CPU: inductor picks its vector ISA from torch's capability level,
    oneDNN and MKL dispatch on the feature flags, and both honour the overrides in the environment."""
    fields = cpuinfo()
    info = {key: fields[key] for key in ("vendor_id", "model name") if key in fields}
    if "flags" in fields:
        info["flags"] = " ".join(sorted(fields["flags"].split()))
    return {
        "capability": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpuinfo": info,
        "caps": cpu_caps(),
    }


def weights_digest(model) -> str:
    """SHA-256 of the model's config and of every parameter and buffer (name, dtype, shape, bytes): the frozen step
    holds them as constants, so any change to them, a further training step included, is another entry. Tied
    weights are read once. Where the checkpoint was loaded from (the config's `_name_or_path`) is left out: a copied or
    moved checkpoint is the same step."""
    config = json.loads(model.config.to_json_string(use_diff=False))
    config.pop("_name_or_path", None)
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    seen = set()
    for name, tensor in model.state_dict(keep_vars=False).items():
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.dtype)
        if key in seen:
            continue
        seen.add(key)
        data = tensor.detach().cpu().contiguous()
        if data.numel():
            digest.update(memoryview(data.view(torch.uint8).reshape(-1).numpy()))
    return digest.hexdigest()


def code_digest(model) -> str:
    """SHA-256 of the source the step is traced from: the model's module file and this package's decode modules."""
    import inspect

    digest = hashlib.sha256()
    files = [inspect.getsourcefile(type(model))] + [os.path.join(os.path.dirname(__file__), s) for s in _SOURCES]
    for path in files:
        digest.update(Path(path).read_bytes() if path and os.path.exists(path) else b"")
    return digest.hexdigest()


def inputs_signature(inputs) -> list:
    return [[list(t.shape), list(t.stride()), t.storage_offset(), str(t.dtype), t.device.type] for t in inputs]


def entry_material(model, kind: str, inputs, settings: dict, weights: str, code: str) -> dict:
    import transformers

    return {
        "format": FORMAT,
        "step": kind,
        "weights": weights,
        "code": code,
        "inputs": inputs_signature(inputs),
        "settings": {key: _setting(value) for key, value in sorted(settings.items())},
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpu": cpu_material(),
    }


def _setting(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    uuid = getattr(value, "uuid", None)  # inductor's custom passes name themselves by a hash of their source
    return f"{type(value).__name__}:{uuid() if callable(uuid) else value!r}"


def entry_name(material: dict) -> str:
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:40]


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class StepPackages:
    """The packages in one directory (`None`: none kept; each step is built into a temporary file and loaded).
    `loaded` and `built` count what this object did; `discarded` lists (entry, reason) for entries it deleted.

    The directory holds at most `max_bytes` (default `default_max_bytes()`): after each build the entries used
    least recently (loading one counts as a use) are deleted until the rest fit, the new one always kept."""

    def __init__(self, directory: str | os.PathLike | None, max_bytes: int | None = None):
        self.directory = Path(directory) if directory is not None else None
        self.max_bytes = default_max_bytes() if max_bytes is None else max_bytes
        self.loaded = self.built = 0
        self.discarded: list[tuple[str, str]] = []

    def paths(self, name: str) -> tuple[Path, Path]:
        return self.directory / f"{name}.pt2", self.directory / f"{name}.json"

    def has(self, material: dict) -> bool:
        """Whether a package for `material` is on disk (not yet checked for damage)."""
        if self.directory is None:
            return False
        package, meta = self.paths(entry_name(material))
        return package.exists() and meta.exists()

    def load(self, material: dict, own: dict[str, torch.Tensor] | None = None):
        """The loaded package for `material` (`own`: as `load_package` takes it), or None when there is none; a stale
        or damaged entry is deleted."""
        if self.directory is None:
            return None
        name = entry_name(material)
        package, meta = self.paths(name)
        if not meta.exists():
            return None
        try:
            recorded = json.loads(meta.read_text())
            if recorded.get("material") != material:
                raise _Invalid("built from something else")
            if not package.exists() or package.stat().st_size != recorded["size"]:
                raise _Invalid("the package is missing or its size differs")
            if _file_sha256(package) != recorded["sha256"]:
                raise _Invalid("the package's checksum differs")
            runner = load_package(package, own)
        except Exception as error:  # anything unreadable is rebuilt, never used
            self.discarded.append((name, f"{type(error).__name__}: {error}"))
            self._remove(name)
            return None
        self.loaded += 1
        try:
            os.utime(meta)  # the entry's last use, which the size limit goes by
        except OSError:
            pass
        return runner

    def build(self, material: dict, compile_package, own: dict[str, torch.Tensor] | None = None):
        """Runs `compile_package(path)` (writes a package to `path`), keeps the package under its entry when there is
        a directory to keep it in, and returns it loaded."""
        self.built += 1
        if self.directory is not None:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                return self._build_into_directory(material, compile_package, own)
            except OSError:  # not writable: the step still gets built, only not kept
                pass
        with tempfile.TemporaryDirectory(prefix="minimind-step-") as scratch:
            path = os.path.join(scratch, "step.pt2")
            compile_package(path)
            return load_package(path, own)

    def _build_into_directory(self, material, compile_package, own):
        name = entry_name(material)
        package, meta = self.paths(name)
        # Written under temporary names and renamed into place, the package before its JSON: a process stopped
        # half-way, or another one building the same entry, leaves no entry that looks complete and is not.
        descriptor, scratch = tempfile.mkstemp(prefix=f".{name}.", suffix=".pt2", dir=self.directory)
        os.close(descriptor)
        try:
            compile_package(scratch)
            record = {"material": material, "size": os.path.getsize(scratch), "sha256": _file_sha256(Path(scratch))}
            os.replace(scratch, package)
        finally:
            if os.path.exists(scratch):
                os.remove(scratch)
        descriptor, scratch_meta = tempfile.mkstemp(prefix=f".{name}.", suffix=".json", dir=self.directory)
        with os.fdopen(descriptor, "w") as file:
            json.dump(record, file, indent=1, sort_keys=True)
        os.replace(scratch_meta, meta)
        self._fit(keep=name)
        return load_package(package, own)

    def _fit(self, keep: str) -> None:
        """Deletes the files of builds stopped long ago, then the least recently used entries until the directory
        holds at most `max_bytes` (`keep`, the entry just built, stays whatever its size)."""
        now, entries = time.time(), []
        for path in self.directory.iterdir():
            try:
                stat = path.stat()
                if path.name.startswith(".") or (path.suffix == ".pt2" and not path.with_suffix(".json").exists()):
                    if now - stat.st_mtime > STRAY_SECONDS:
                        path.unlink()
                elif path.suffix == ".json":
                    package = path.with_suffix(".pt2")
                    size = stat.st_size + (package.stat().st_size if package.exists() else 0)
                    entries.append((stat.st_mtime, path.stem, size))
            except OSError:  # removed meanwhile by another process
                continue
        total = sum(size for _, _, size in entries)
        for _, name, size in sorted(entries):
            if total <= self.max_bytes:
                break
            if name != keep:
                self._remove(name)
                self.discarded.append((name, f"the cache is over {self.max_bytes / 1e9:g} GB; least recently used"))
                total -= size

    def _remove(self, name: str) -> None:
        for path in self.paths(name):
            try:
                path.unlink()
            except OSError:
                pass


class _Invalid(Exception):
    pass
