"""Logging for lorafleet_sync: named loggers, and a CLI handler that masks secrets in everything it writes."""

from __future__ import annotations

import logging
import os
import sys

SECRET_ENV_VARS = (
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_ACCESS_KEY_ID",
)


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)


class SecretMaskingFormatter(logging.Formatter):
    """Formats a record (message, arguments, traceback) and replaces every known secret with '***'."""

    def __init__(self, fmt: str, secrets: list[str]) -> None:
        super().__init__(fmt)
        self.secrets = sorted({s for s in secrets if s and len(s) >= 4}, key=len, reverse=True)

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        for secret in self.secrets:
            text = text.replace(secret, "***")
        return text


def secrets_from_env() -> list[str]:
    return [os.environ.get(name, "") for name in SECRET_ENV_VARS]


def setup_cli_logging(verbose: bool = False) -> None:
    """Log to stderr (stdout is reserved for the machine-readable result), secrets masked."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(SecretMaskingFormatter("%(asctime)s %(levelname)s %(message)s", secrets_from_env()))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    logging.getLogger("lorafleet_sync").setLevel(logging.DEBUG if verbose else logging.INFO)
    # Client libraries log request details at DEBUG; keep them quiet.
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer", "huggingface_hub", "httpx", "httpx2", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
