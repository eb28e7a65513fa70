# Runs in the MinIO pod (operator image: python + boto3): create $BUCKET once MinIO answers.
import os
import sys
import time

import boto3
from botocore.exceptions import BotoCoreError, ClientError

s3 = boto3.client("s3", endpoint_url=os.environ["MINIO_URL"], region_name=os.environ.get("AWS_REGION", "us-east-1"))
bucket = os.environ["BUCKET"]
while True:
    try:
        s3.head_bucket(Bucket=bucket)
        break
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchBucket", "NotFound"):
            s3.create_bucket(Bucket=bucket)
            break
        print(f"waiting for MinIO: {exc}", file=sys.stderr, flush=True)
    except BotoCoreError as exc:
        print(f"waiting for MinIO: {exc}", file=sys.stderr, flush=True)
    time.sleep(2)
print(f"bucket {bucket} ready", flush=True)
while True:  # stay up: a finished container would be restarted
    time.sleep(3600)
