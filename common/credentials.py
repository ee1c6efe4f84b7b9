"""Credentials for object stores: where --storage-options is read from, and which values never show.

A command line is readable by every user of the machine (`ps`, /proc/PID/cmdline) and launchers echo
it (a Slurm output file keeps it), so --storage-options takes its JSON from a file (@path.json) or an
environment variable (env:NAME) as well as inline. Every value under a credential-bearing option of
fsspec's common back ends, at any depth, is scrubbed from the messages that could quote it.
Standard library only: launch/k8s.sh imports it on machines without torch.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import unquote

EXAMPLE = '\'{"endpoint_url": "http://127.0.0.1:9000"}\''

# An option carries credentials when its lower-case name (- read as _) contains one of these words.
# They cover fsspec's common back ends: s3fs key, secret, token, client_kwargs.aws_access_key_id /
# aws_secret_access_key / aws_session_token; gcsfs token (a path or the service account's dict);
# adlfs account_key, sas_token, connection_string, client_secret, credential; HTTP headers'
# Authorization, Proxy-Authorization, Cookie, X-Api-Key and client_kwargs.auth; ftp, sftp and smb
# password, passphrase, pkey. Everything under such an option (a dict, a list) counts as secret.
CREDENTIAL_WORDS = ("key", "secret", "token", "password", "passwd", "passphrase", "credential", "auth", "cookie",
                    "connection_string")
# Variables the back ends read credentials from by themselves.
CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AZURE_STORAGE_KEY",
                  "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_SAS_TOKEN",
                  "AZURE_CLIENT_SECRET")
URL_PASSWORD = re.compile(r"://[^/@\s:]*:([^/@\s]+)@")  # scheme://user:PASSWORD@host, in any option's value
SHORTEST_SECRET = 4  # scrubbing shorter values would blank ordinary words of a message


def read_storage_options(value: str) -> dict[str, Any]:
    """The --storage-options object from inline JSON, @path.json or env:NAME. A bad one raises
    ValueError with one line that names the file or variable and never quotes what it holds."""
    where, text = _storage_options_text(value)
    try:
        options = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); give an object "
                         f"such as {EXAMPLE}") from None
    if not isinstance(options, dict):
        raise ValueError(f"{where}must be a JSON object, e.g. {EXAMPLE}")
    return options


def _storage_options_text(value: str) -> tuple[str, str]:
    """(how to name the source in an error, its text)."""
    if value.startswith("@"):
        path = value[1:]
        try:
            return f"{value}: the file ", Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"{value}: cannot read the file ({e.strerror or type(e).__name__}); give a JSON file "
                             "that every node can read at that path") from None
        except UnicodeDecodeError:
            raise ValueError(f"{value}: the file is not UTF-8 text; give a JSON file") from None
    if value.startswith("env:"):
        name = value.removeprefix("env:")
        if name not in os.environ:
            raise ValueError(f"{value}: the environment variable {name} is not set; export it (a JSON object) "
                             "where every rank starts")
        return f"{value}: the variable ", os.environ[name]
    return "", value


def is_credential_name(name: str) -> bool:
    normal = name.lower().replace("-", "_")
    return any(word in normal for word in CREDENTIAL_WORDS)


def credentials_in(options: Any, path: str = "", hidden: bool = False) -> Iterator[tuple[str, str]]:
    """(where, value) of every credential in the options: `where` is the option's dotted name (for
    messages that say which options to move; never the value)."""
    if isinstance(options, dict):
        for key, value in options.items():
            yield from credentials_in(value, f"{path}.{key}".lstrip("."), hidden or is_credential_name(str(key)))
    elif isinstance(options, (list, tuple)):
        for index, value in enumerate(options):
            yield from credentials_in(value, f"{path}[{index}]", hidden)
    elif isinstance(options, (str, int, float)) and not isinstance(options, bool) and hidden:
        yield path, str(options)
    elif isinstance(options, str):
        for password in URL_PASSWORD.findall(options):
            yield path, password


def secrets_in(options: dict[str, Any]) -> list[str]:
    """Every value to scrub from messages: the credential options' and the standard variables',
    longest first (a secret that holds another one is scrubbed whole)."""
    found = {os.environ.get(name, "") for name in CREDENTIAL_ENV}
    for _, value in credentials_in(options):
        found |= {value, unquote(value)}  # a URL's password may appear decoded
    return sorted((s for s in found if len(s) >= SHORTEST_SECRET), key=len, reverse=True)
