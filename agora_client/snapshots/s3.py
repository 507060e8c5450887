"""Snapshots in an S3-compatible bucket (AWS S3, MinIO, R2) through boto3.

The location is ``s3://bucket/prefix``. Endpoint, region and credentials come from boto3's usual
sources (``AWS_ENDPOINT_URL``, ``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``,
profiles), so MinIO or R2 need only ``AWS_ENDPOINT_URL``. Joiners never hold credentials: the auth
service hands them ``joiner_url(stage)``, a presigned GET URL of a manifest whose files carry their
own presigned URLs, which ``download_snapshot`` follows unchanged (Range requests included).
"""

from __future__ import annotations

import json
import os
import secrets
import tempfile
import threading
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from .format import LATEST_FILE, MANIFEST_FILE, SnapshotError, check_manifest, snapshot_time
from .store import TRAINERS_DIR, SnapshotStore, StoredSnapshot

SIGNED_PREFIX = ".signed"  # signed manifests for joiners; a dot name is never a stage
DEFAULT_LINK_SECONDS = 3600.0


class S3Store(SnapshotStore):
    def __init__(self, location: str):
        bucket, _, prefix = location.removeprefix("s3://").partition("/")
        if not bucket:
            raise SnapshotError(f"{location} names no bucket: write s3://bucket or s3://bucket/prefix")
        self.location, self.bucket = location, bucket
        self.prefix = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
        addressing = "path" if os.environ.get("AWS_ENDPOINT_URL") else "auto"  # MinIO / local servers want path style
        self.client = boto3.client("s3", config=Config(signature_version="s3v4", s3={"addressing_style": addressing}))
        self._links: dict[tuple[str, str], tuple[str, float]] = {}
        self._links_lock = threading.Lock()

    # -- SnapshotStore ---------------------------------------------------------------------------------

    def stages(self) -> list[str]:
        found: set[str] = set()
        for page in self._pages(Prefix=self.prefix, Delimiter="/"):
            for common in page.get("CommonPrefixes", []):
                name = common["Prefix"][len(self.prefix) :].strip("/")
                if name and not name.startswith(".") and name != TRAINERS_DIR:
                    found.add(name)
        return sorted(found)

    def put_record(self, key: str, data: dict[str, Any]) -> None:
        body = json.dumps(data, separators=(",", ":")).encode()
        self._call(
            self.client.put_object,
            Bucket=self.bucket,
            Key=f"{self.prefix}{key}",
            Body=body,
            ContentType="application/json",
        )

    def get_record(self, key: str) -> dict[str, Any]:
        data = self._get_json(f"{self.prefix}{key}")
        if not isinstance(data, dict):
            raise SnapshotError(f"s3://{self.bucket}/{self.prefix}{key} is not a JSON object")
        return data

    def record_names(self, folder: str) -> list[str]:
        prefix = f"{self.prefix}{folder.strip('/')}/"
        names = [item["Key"][len(prefix) :] for page in self._pages(Prefix=prefix) for item in page.get("Contents", [])]
        return sorted(name for name in names if name.endswith(".json") and "/" not in name)

    def remove_record(self, key: str) -> None:
        self._call(self.client.delete_object, Bucket=self.bucket, Key=f"{self.prefix}{key}")

    def list(self, stage: str) -> list[StoredSnapshot]:
        found = []
        for page in self._pages(Prefix=f"{self.prefix}{stage}/"):
            for item in page.get("Contents", []):
                parts = item["Key"][len(self.prefix) :].split("/")
                if len(parts) == 3 and parts[2] == MANIFEST_FILE and (moment := snapshot_time(parts[1])) is not None:
                    found.append(StoredSnapshot(moment, stage, parts[1]))
        return sorted(found)

    def manifest(self, snapshot: StoredSnapshot) -> dict[str, Any]:
        key = self._key(snapshot, MANIFEST_FILE)
        return check_manifest(self._get_json(key), f"s3://{self.bucket}/{key}")

    def local_dir(self, snapshot: StoredSnapshot, cache: Path, files: Collection[str] | None = None) -> Path:
        target = Path(cache) / snapshot.stage / snapshot.name
        target.mkdir(parents=True, exist_ok=True)
        manifest = self.manifest(snapshot)
        wanted = [name for name in manifest["files"] if files is None or name in files]
        for name in [*wanted, MANIFEST_FILE]:
            part = target / f"{name}.part"
            self._call(self.client.download_file, self.bucket, self._key(snapshot, name), str(part))
            os.replace(part, target / name)
        return target

    def remove(self, snapshot: StoredSnapshot) -> None:
        prefix = f"{self.prefix}{snapshot.stage}/{snapshot.name}/"
        for page in self._pages(Prefix=prefix):
            keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
            if keys:
                self._call(self.client.delete_objects, Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True})

    def _staging_place(self, stage: str) -> tuple[Path, str]:
        return Path(tempfile.gettempdir()), f"agora-{stage}-"  # uploaded from here, file by file

    def _commit(self, stage: str, name: str, staging: Path) -> None:
        files = sorted(path.name for path in staging.iterdir() if path.name != MANIFEST_FILE)
        for file_name in [*files, MANIFEST_FILE]:  # the manifest last: its presence means complete
            self._call(
                self.client.upload_file,
                str(staging / file_name),
                self.bucket,
                f"{self.prefix}{stage}/{name}/{file_name}",
            )
        latest = {
            "stage": stage,
            "epoch": int(name.split("-", 1)[0]),
            "timestamp": snapshot_time(name),
            "manifest": f"{name}/{MANIFEST_FILE}",
        }
        self._put_json(f"{self.prefix}{stage}/{LATEST_FILE}", latest)

    # -- joiners -----------------------------------------------------------------------------------------

    def joiner_url(self, stage: str, expires_s: float = DEFAULT_LINK_SECONDS) -> str | None:
        """A presigned URL of the stage's newest snapshot manifest, its files presigned too; None if none yet."""
        snapshots = self.list(stage)
        if not snapshots:
            return None
        newest = snapshots[-1]
        now = time.time()
        with self._links_lock:
            cached = self._links.get((stage, newest.name))
            if cached and cached[1] - now > expires_s / 2:  # reuse a link while it has half its life left
                return cached[0]
            manifest = self.manifest(newest)
            for name, entry in manifest["files"].items():
                entry["url"] = self._presign(self._key(newest, name), expires_s)
            key = f"{self.prefix}{SIGNED_PREFIX}/{stage}-{newest.name}-{secrets.token_hex(8)}.json"
            self._put_json(key, manifest)
            url = self._presign(key, expires_s)
            self._links = {k: v for k, v in self._links.items() if v[1] > now}
            self._links[(stage, newest.name)] = (url, now + expires_s)
            self._drop_expired_signed(now - expires_s)
        return url

    def _drop_expired_signed(self, before: float) -> None:
        for page in self._pages(Prefix=f"{self.prefix}{SIGNED_PREFIX}/"):
            old = [
                {"Key": item["Key"]} for item in page.get("Contents", []) if item["LastModified"].timestamp() < before
            ]
            if old:
                self._call(self.client.delete_objects, Bucket=self.bucket, Delete={"Objects": old, "Quiet": True})

    # -- internals ---------------------------------------------------------------------------------------

    def _key(self, snapshot: StoredSnapshot, file_name: str) -> str:
        return f"{self.prefix}{snapshot.stage}/{snapshot.name}/{file_name}"

    def _presign(self, key: str, expires_s: float) -> str:
        params = {"Bucket": self.bucket, "Key": key}
        return self._call(self.client.generate_presigned_url, "get_object", Params=params, ExpiresIn=int(expires_s))

    def _pages(self, **kwargs: Any):
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            yield from paginator.paginate(Bucket=self.bucket, **kwargs)
        except (BotoCoreError, ClientError) as error:
            raise SnapshotError(self._explain(error)) from None

    def _get_json(self, key: str) -> Any:
        body = self._call(self.client.get_object, Bucket=self.bucket, Key=key)["Body"].read()
        try:
            return json.loads(body)
        except ValueError:
            raise SnapshotError(f"s3://{self.bucket}/{key} is not JSON; the store is damaged") from None

    def _put_json(self, key: str, data: dict[str, Any]) -> None:
        body = json.dumps(data, indent=2, sort_keys=True).encode()
        self._call(self.client.put_object, Bucket=self.bucket, Key=key, Body=body, ContentType="application/json")

    def _call(self, function, *args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except (BotoCoreError, ClientError) as error:
            raise SnapshotError(self._explain(error)) from None

    def _explain(self, error: Exception) -> str:
        # botocore's messages name the operation and the code, never the credentials
        return (
            f"S3 store {self.location}: {error}; check the bucket name, AWS_ENDPOINT_URL and the "
            "credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or a profile)"
        )
