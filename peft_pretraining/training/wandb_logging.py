"""wandb: which mode (never a login prompt), the run folder's wandb run id (kept across resumes), and the run."""
import netrc
import os
import re
import secrets

from peft_pretraining.training import run_folder


def wandb_api_key_available() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def wandb_mode() -> str:
    """WANDB_MODE when set (but online only with an API key); unset: online with a key, offline without one.

    Never a login prompt."""
    mode = os.environ.get("WANDB_MODE", "").strip().lower()
    if mode in ("disabled", "offline", "dryrun"):
        return "disabled" if mode == "disabled" else "offline"
    if mode == "online" or not mode:
        return "online" if wandb_api_key_available() else "offline"
    return "offline"


WANDB_ID_FILE = "wandb_run_id"
_WANDB_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def wandb_run_id(run_dir: str, resume: bool) -> str:
    """The wandb run id of run_dir's history: kept in RUN/wandb_run_id, so that every resume of the folder logs to
    the same wandb run. A fresh start (a new history) draws a new id and replaces the file; a resume reuses the
    file's id (a folder whose earlier legs ran with wandb disabled has none yet: a new one is drawn and kept).
    ValueError naming the file when it holds no valid id."""
    path = os.path.join(run_dir, WANDB_ID_FILE)
    if resume and os.path.exists(path):
        try:
            with open(path) as f:
                run_id = f.read().strip()
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"{path}: cannot be read ({err}); remove it to start a new wandb run") from err
        if not _WANDB_ID.fullmatch(run_id):
            raise ValueError(f"{path}: {run_id[:80]!r} is not a wandb run id; remove it to start a new wandb run")
        return run_id
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    run_id = "".join(secrets.choice(alphabet) for _ in range(8))  # the form wandb's own ids take
    run_folder.write_lines_atomic(path, [run_id + "\n"])
    return run_id


def init_wandb(*, project: str, run_name: str, config: dict, tags, run_dir: str, resume: bool = False):
    """A wandb run writing under run_dir, or None when WANDB_MODE=disabled.

    Its id is the run folder's (wandb_run_id): a resume continues the same wandb run (resume="allow"), online and
    offline (an offline leg is a new RUN/wandb/offline-run-<time>-<id> folder with the same id)."""
    mode = wandb_mode()
    if mode == "disabled":
        return None
    run_id = wandb_run_id(run_dir, resume)
    import wandb
    return wandb.init(project=project, name=run_name, config=config, tags=tags, dir=run_dir, mode=mode,
                      id=run_id, resume="allow",
                      settings=wandb.Settings(init_timeout=120, console="off"))
