"""``lorafleet-sync``: copy a Hugging Face adapter into S3/MinIO (SPEC §6). See ``--help``."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from . import hf, s3
from .errors import SourceError
from .log import get_logger, setup_cli_logging
from .retry import FetchPolicy, retry_call
from .sync import ExitCode, exit_code_for, sync
from .uris import S3URI, HfURI, URIError, parse_uri

log = get_logger("lorafleet_sync.cli")

DESCRIPTION = """\
Copy the adapter files of a Hugging Face repository into S3/MinIO, under its commit SHA:

  hf://ORG/REPO[@REV]  ->  s3://BUCKET[/PREFIX]/ORG/REPO/SHA/

REV (a branch, tag or commit; default main) is resolved to a commit SHA first. Every file of the
repository except dot-files is uploaded (objects carry x-amz-meta-sha256), then
lorafleet-manifest.json (files, sizes, sha256, source, sha) is written last. Re-running with
nothing changed uploads nothing. The bucket must exist.

Progress goes to stderr; the last line on stdout is the resolved s3:// URI."""

EPILOG = """\
environment:
  HF_ENDPOINT, HF_TOKEN               Hugging Face Hub (default https://huggingface.co)
  AWS_ENDPOINT_URL_S3 > AWS_ENDPOINT_URL > AWS_ENDPOINT
                                      S3 endpoint (MinIO); path-style addressing
  AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION (default us-east-1)
  AWS_ALLOW_HTTP=true                 required for a plain http:// endpoint
  Secrets are never logged.

exit codes:
  0   synced (or already up to date)
  64  usage error (malformed --source or --dest)
  65  permanent failure: no such repository, revision or bucket; not an adapter; credentials refused
  70  internal error
  75  temporary failure (hub or object store unreachable, timed out, 5xx): retry later

example:
  lorafleet-sync --source hf://my-org/my-lora@main --dest s3://adapters/hf"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(ExitCode.USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="lorafleet-sync",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--source", required=True, metavar="hf://ORG/REPO[@REV]", help="Hugging Face adapter")
    parser.add_argument("--dest", required=True, metavar="s3://BUCKET[/PREFIX]", help="destination bucket/prefix")
    parser.add_argument(
        "--deadline", type=float, default=300.0, metavar="SECONDS",
        help="retry temporary failures with backoff for up to this long (default 300)",
    )  # fmt: skip
    parser.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS", help="per-request timeout")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_cli_logging(args.verbose)
    try:
        source, dest = parse_uri(args.source), parse_uri(args.dest)
    except URIError as exc:
        parser.error(str(exc))
    if not isinstance(source, HfURI):
        parser.error(f"--source must be hf://org/repo[@revision], got {args.source!r}")
    if not isinstance(dest, S3URI):
        parser.error(f"--dest must be s3://bucket[/prefix], got {args.dest!r}")

    hf_settings, s3_settings = hf.HfSettings.from_env(), s3.S3Settings.from_env()
    policy = FetchPolicy(deadline_s=args.deadline)
    try:
        result = retry_call(
            lambda: sync(source, dest, hf_settings=hf_settings, s3_settings=s3_settings, timeout=args.timeout),
            policy,
            f"sync of {source}",
        )
    except SourceError as err:
        code = exit_code_for(err)
        log.error("sync failed (%s, exit %d): %s", "retryable" if err.retryable else "permanent", code, err.message)
        return code
    except Exception:
        log.exception("sync failed with an internal error")
        return ExitCode.SOFTWARE
    log.info(
        "done: %d uploaded, %d unchanged, manifest %s",
        len(result.uploaded), len(result.unchanged), "written" if result.manifest_written else "unchanged",
    )  # fmt: skip
    print(str(result.uri), flush=True)
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
