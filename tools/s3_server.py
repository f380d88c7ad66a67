"""A local S3 endpoint (moto's server) on 127.0.0.1, for tests and for trying zeroshard with s3://.

    python tools/s3_server.py [--port 5555] [--bucket ckpt]

prints `S3 endpoint http://127.0.0.1:PORT` once it is ready, then serves until killed. Point
zeroshard at it with AWS_ENDPOINT_URL=http://127.0.0.1:PORT AWS_ACCESS_KEY_ID=testing
AWS_SECRET_ACCESS_KEY=testing (moto accepts any credentials). State lives in memory only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--bucket", action="append", default=[], help="bucket to create (repeatable)")
    args = parser.parse_args()
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=args.port, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    if args.bucket:
        import boto3

        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                              aws_access_key_id="testing", aws_secret_access_key="testing")
        for bucket in args.bucket:
            client.create_bucket(Bucket=bucket)
    print(f"S3 endpoint {endpoint}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
