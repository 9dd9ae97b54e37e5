"""The ``auth`` section of the application's settings: optional API keys.

Keys come inline (``auth.api_keys``) or from a file (``auth.api_keys_file``: one key a line,
blank lines and ``#`` comment lines ignored), or both (their union). With none, the API is
open. The file is read when the settings are validated (``serve run`` refuses an unreadable
or empty one, naming the field) and once more by each ingress replica as it starts; a changed
file takes effect on redeploy. The messages here never contain a key: a bad line is named by
its number. Keys given inline are ``SecretStr`` (``repr`` shows stars); prefer the file, which
keeps them out of the Serve config.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator


def check_key(key: str) -> str | None:
    """What is wrong with ``key`` as a bearer token (None: nothing). Keys are printable ASCII
    without spaces (what an ``Authorization`` header carries as one token)."""
    if not key:
        return "is empty"
    if not all("!" <= ch <= "~" for ch in key):
        return "has a character outside printable ASCII, or a space"
    return None


def read_key_file(path: Path) -> list[str]:
    """The keys in ``path``; ``ValueError`` naming the file (and a bad line by its number)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {type(exc).__name__}: {getattr(exc, 'strerror', None) or exc}") from None
    keys = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        problem = check_key(line)
        if problem is not None:
            raise ValueError(f"{path} line {number}: the key {problem}")
        keys.append(line)
    if not keys:
        raise ValueError(f"{path} holds no key (only blank or # comment lines)")
    return keys


class AuthConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    api_keys: list[SecretStr] = Field(
        default_factory=list, description="API keys clients send as 'Authorization: Bearer <key>'; none: no auth"
    )
    api_keys_file: Path | None = Field(
        None, description="a file of API keys, one a line (# comments ignored), read at start; with api_keys: both"
    )

    @field_validator("api_keys")
    @classmethod
    def _printable(cls, keys: list[SecretStr]) -> list[SecretStr]:
        for index, key in enumerate(keys):
            problem = check_key(key.get_secret_value())
            if problem is not None:
                raise ValueError(f"key {index} {problem}")
        return keys

    @field_validator("api_keys_file")
    @classmethod
    def _readable(cls, path: Path | None) -> Path | None:
        if path is not None:
            read_key_file(path)
        return path

    @property
    def enabled(self) -> bool:
        return bool(self.api_keys) or self.api_keys_file is not None

    def keys(self) -> list[str]:
        """Every key: the inline ones, then the file's (read now)."""
        inline = [key.get_secret_value() for key in self.api_keys]
        return inline + (read_key_file(self.api_keys_file) if self.api_keys_file is not None else [])
