"""SQS on the moto server, driven with plain boto3 as the live backend drives it."""

from __future__ import annotations

import json
import uuid
from typing import Any

import boto3

from tests.conftest import TEST_REGION


def sqs_client(endpoint: str) -> Any:
    return boto3.client("sqs", endpoint_url=endpoint, region_name=TEST_REGION)


def new_queue(endpoint: str, name: str, *, fifo: bool = False, visibility: int = 60) -> str:
    """A fresh queue; the FIFO form for the bots' forward queue."""
    suffix = uuid.uuid4().hex[:10]
    attributes = {"VisibilityTimeout": str(visibility), "MessageRetentionPeriod": "86400"}
    if fifo:
        attributes["FifoQueue"] = "true"
    url: str = sqs_client(endpoint).create_queue(
        QueueName=f"{name}-{suffix}{'.fifo' if fifo else ''}", Attributes=attributes
    )["QueueUrl"]
    return url


def send(endpoint: str, queue_url: str, body: Any) -> str:
    """``enqueueBotOutbound``: one SendMessage with the JSON body (a str is sent as is)."""
    text = body if isinstance(body, str) else json.dumps(body)
    message_id: str = sqs_client(endpoint).send_message(QueueUrl=queue_url, MessageBody=text)[
        "MessageId"
    ]
    return message_id


def send_many(endpoint: str, queue_url: str, bodies: list[Any]) -> None:
    client = sqs_client(endpoint)
    for start in range(0, len(bodies), 10):
        chunk = bodies[start : start + 10]
        entries = [
            {"Id": str(i), "MessageBody": b if isinstance(b, str) else json.dumps(b)}
            for i, b in enumerate(chunk)
        ]
        response = client.send_message_batch(QueueUrl=queue_url, Entries=entries)
        assert not response.get("Failed"), response


def depth(endpoint: str, queue_url: str) -> int:
    attributes = sqs_client(endpoint).get_queue_attributes(
        QueueUrl=queue_url,
        AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
    )["Attributes"]
    return int(attributes["ApproximateNumberOfMessages"]) + int(
        attributes["ApproximateNumberOfMessagesNotVisible"]
    )


def drain_bodies(endpoint: str, queue_url: str) -> list[str]:
    """Every body now in the queue, received and deleted (what the webhook Lambda takes)."""
    client = sqs_client(endpoint)
    bodies: list[str] = []
    while True:
        response = client.receive_message(
            QueueUrl=queue_url, MaxNumberOfMessages=10, WaitTimeSeconds=0, VisibilityTimeout=60
        )
        messages = response.get("Messages", [])
        if not messages:
            return bodies
        for message in messages:
            bodies.append(message["Body"])
            client.delete_message(QueueUrl=queue_url, ReceiptHandle=message["ReceiptHandle"])
