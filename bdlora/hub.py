"""The Hugging Face Hub through huggingface_hub: base models (and dataset snapshots) downloaded into the standard
cache, adapters pushed to a repository. Honours what huggingface_hub honours: ``HF_TOKEN`` (or ``hf auth login``),
``HF_HOME`` / ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE`` and ``HF_ENDPOINT``. Every failure is a :class:`HubError` that
names the repository and a command that exists (``hf download``, ``hf auth login``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from .spec import BDLoraError

#: What a transformers model needs (weights as safetensors, configs, tokenizer files, chat templates); not the
#: duplicates some repositories carry (.bin / .pth / GGUF / original/ checkpoints).
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "*.py", "tokenizer*"]
#: The data files bdlora reads from a dataset repository (and its card).
DATASET_FILES = ["*.json", "*.jsonl", "*.parquet", "*.csv", "*.arrow", "README.md"]


def is_repo_id(name: str) -> bool:
    """``org/name``: two non-empty parts, neither a path (``.``, ``~``, ``/``) nor holding whitespace."""
    parts = name.split("/")
    return len(parts) == 2 and all(p and not p.startswith((".", "~")) and not any(c.isspace() for c in p)
                                   for p in parts)


class HubError(BDLoraError):
    """A hub repository could not be read or written; the message names it and what to do."""


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def cache_dir() -> str:
    """Where huggingface_hub keeps downloaded snapshots (HF_HOME/hub unless HF_HUB_CACHE says otherwise)."""
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def cached_snapshot(repo_id: str, revision: Optional[str] = None, repo_type: str = "model") -> Optional[Path]:
    """The cached snapshot folder of ``repo_id`` (None when it is not in the cache); never asks the hub."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, revision=revision, repo_type=repo_type, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached (huggingface_hub raises several kinds for that)
        return None


def _download_command(repo_id: str, repo_type: str) -> str:
    return f"hf download {repo_id}" + (" --repo-type dataset" if repo_type == "dataset" else "")


def download(repo_id: str, revision: Optional[str] = None, repo_type: str = "model",
             patterns: Optional[list[str]] = None) -> Path:
    """The snapshot folder of ``repo_id``: from the cache, else downloaded (``patterns``; by default the files of
    MODEL_FILES or DATASET_FILES). A :class:`HubError` naming the repository when it is missing offline, gated, private,
    unknown or unreachable."""
    found = cached_snapshot(repo_id, revision, repo_type)
    if found is not None and (patterns is None or any(found.glob(p) for p in patterns)):
        return found
    what = "dataset" if repo_type == "dataset" else "model"
    fetch = _download_command(repo_id, repo_type)
    if offline():
        raise HubError(f"{what} {repo_id!r} is not in the local Hugging Face cache ({cache_dir()}) and HF_HUB_OFFLINE "
                       f"is set; unset it to download, or on a machine with network run `{fetch}` with the same "
                       "HF_HOME and copy that cache here")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    patterns = patterns or (DATASET_FILES if repo_type == "dataset" else MODEL_FILES)
    try:
        return Path(snapshot_download(repo_id, revision=revision, repo_type=repo_type, allow_patterns=patterns))
    except GatedRepoError:
        raise HubError(f"{what} {repo_id!r} is gated: accept its terms on its hub page, then set HF_TOKEN (or run "
                       "`hf auth login`) with a token of that account") from None
    except RevisionNotFoundError:
        raise HubError(f"{what} {repo_id!r} has no revision {revision!r}") from None
    except RepositoryNotFoundError:
        raise HubError(f"{what} {repo_id!r} was not found on the hub (a private repository needs HF_TOKEN or "
                       "`hf auth login`); check the id") from None
    except HfHubHTTPError as e:
        raise HubError(f"{what} {repo_id!r}: the hub answered {e}") from None
    except (OSError, ValueError) as e:  # connection errors, a full disk, an invalid id
        raise HubError(f"{what} {repo_id!r} could not be downloaded ({type(e).__name__}: {e}); check the network "
                       f"(or run `{fetch}` where there is one) and the free space under {cache_dir()}") from None


def push_adapter(folder: str | os.PathLike, repo_id: str, private: bool = False,
                 commit_message: str = "Upload BD-LoRA adapter (bdlora)") -> str:
    """Uploads an adapter folder (checked with bdlora's strict reader first) to the model repository ``repo_id``,
    creating it when missing; returns the repository's URL."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    from .adapter import load_adapter

    load_adapter(folder)  # a folder bdlora would refuse to serve is never published
    if offline():
        raise HubError(f"cannot push to {repo_id!r}: HF_HUB_OFFLINE is set; unset it (and log in with HF_TOKEN or "
                       "`hf auth login`)")
    api = HfApi()
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        api.upload_folder(repo_id=repo_id, folder_path=str(folder), commit_message=commit_message,
                          repo_type="model")
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403):
            raise HubError(f"cannot push to {repo_id!r}: not allowed ({status}); set HF_TOKEN to a token with write "
                           "access (or run `hf auth login`)") from None
        raise HubError(f"cannot push to {repo_id!r}: the hub answered {e}") from None
    except (OSError, ValueError) as e:
        raise HubError(f"cannot push to {repo_id!r} ({type(e).__name__}: {e})") from None
    return str(url)


__all__ = ["DATASET_FILES", "HubError", "MODEL_FILES", "cache_dir", "cached_snapshot", "download", "is_repo_id",
           "offline", "push_adapter"]
