"""deploy/aws/ap-realtime.yaml: lint-clean, least privilege per feature, timings in order.

Three kinds of check:

- ``cfn-lint`` (the version pinned in the ``test`` extra) finds no error and no warning.
- The parsed template: no wildcard action; the task role's permissions are exactly what
  the code calls, one policy per feature under that feature's condition; the drain, the
  timeouts, the health check and the ports agree with each other.
- The stack created in a moto server, both with every feature on and with none, and
  read back through the services' own APIs. moto's CloudFormation has no ElastiCache and
  no Application Auto Scaling resource types, and ignores some properties of the types it
  has; what is read back from moto, and what only the parsed template checks, is listed
  at ``MOTO_UNSUPPORTED`` and in ``test_stack_in_moto``.
"""

from __future__ import annotations

import ast
import functools
import json
import re
import subprocess
import sys
import time
import tomllib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import boto3
import pytest
from cfnlint.decode import decode

from server.config import Settings, load

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "deploy" / "aws" / "ap-realtime.yaml"

Node = Any
"""A node of the parsed template: a dict, a list, a str or a number."""


@functools.cache
def _parsed() -> str:
    template, errors = decode(str(TEMPLATE))
    assert not errors, errors
    return json.dumps(template)  # plain JSON types, and a copy per caller below


def template() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(_parsed())
    return loaded


def resources(of_type: str | None = None) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = template()["Resources"]
    return {k: v for k, v in found.items() if of_type is None or v["Type"] == of_type}


def props(logical_id: str) -> dict[str, Any]:
    properties: dict[str, Any] = template()["Resources"][logical_id]["Properties"]
    return properties


def container() -> dict[str, Any]:
    (only,) = props("TaskDefinition")["ContainerDefinitions"]
    assert isinstance(only, dict)
    return only


def branches(node: Node, condition: str | None = None) -> Iterator[tuple[str | None, Node]]:
    """Each value an element may take, with the condition it takes it under.

    ``{"Fn::If": [C, a, b]}`` gives ``(C, a)`` and ``("!C", b)``; ``AWS::NoValue`` gives
    nothing. One level deep, which is all this template uses.
    """
    if isinstance(node, dict) and "Fn::If" in node:
        name, when_true, when_false = node["Fn::If"]
        for value, cond in ((when_true, name), (when_false, "!" + name)):
            if value != {"Ref": "AWS::NoValue"}:
                yield cond, value
    else:
        yield condition, node


def environment() -> dict[str, tuple[str | None, Node]]:
    """``AP_*`` name -> (condition, value) of the container's environment."""
    found: dict[str, tuple[str | None, Node]] = {}
    for element in container()["Environment"]:
        for condition, pair in branches(element):
            assert pair["Name"] not in found, f"{pair['Name']} set twice"
            found[pair["Name"]] = (condition, pair["Value"])
    return found


def literal(name: str) -> str:
    condition, value = environment()[name]
    assert condition is None and isinstance(value, str), f"{name} is not a plain value"
    return value


@dataclass(frozen=True)
class Statement:
    policy: str  # the logical id of the role or policy resource it is written in
    condition: str | None  # a resource's Condition, or the Fn::If around the statement
    actions: frozenset[str]
    resource: Node


def statements(role: str) -> list[Statement]:
    """Every statement that grants ``role`` something: inline, or in an AWS::IAM::Policy."""
    found: list[Statement] = []
    role_props = props(role)
    documents = [
        (role, None, policy["PolicyDocument"]) for policy in role_props.get("Policies", [])
    ]
    assert not role_props.get("ManagedPolicyArns"), f"{role} has managed policies"
    for logical_id, resource in resources("AWS::IAM::Policy").items():
        if {"Ref": role} in resource["Properties"]["Roles"]:
            documents.append(
                (logical_id, resource.get("Condition"), resource["Properties"]["PolicyDocument"])
            )
    for policy, resource_condition, document in documents:
        for element in document["Statement"]:
            for condition, statement in branches(element, resource_condition):
                assert statement["Effect"] == "Allow"
                actions = statement["Action"]
                actions = [actions] if isinstance(actions, str) else actions
                found.append(
                    Statement(policy, condition, frozenset(actions), statement["Resource"])
                )
    return found


def references(node: Node) -> set[str]:
    """Parameters and resources a node names through Ref, GetAtt or Sub."""
    names: set[str] = set()
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "Ref":
                names.add(value)
            elif key == "Fn::GetAtt":
                names.add(value[0] if isinstance(value, list) else value.split(".")[0])
            elif key == "Fn::Sub":
                text = value if isinstance(value, str) else value[0]
                names |= {m.split(".")[0] for m in re.findall(r"\$\{([^}!]+)\}", text)}
                names |= references(value)
            else:
                names |= references(value)
    elif isinstance(node, list):
        for item in node:
            names |= references(item)
    return names


# --------------------------------------------------------------------------- lint


def test_cfn_lint_finds_nothing_with_the_pinned_version() -> None:
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["test"]
    (pin,) = [spec for spec in extra if spec.startswith("cfn-lint")]
    assert pin == f"cfn-lint=={metadata.version('cfn-lint')}", "run scripts/bootstrap"
    result = subprocess.run(
        [str(Path(sys.executable).parent / "cfn-lint"), str(TEMPLATE)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


# ---------------------------------------------------------------------------- IAM


def test_no_action_is_a_wildcard_and_only_ecr_login_has_no_resource() -> None:
    for role in resources("AWS::IAM::Role"):
        for statement in statements(role):
            assert not any("*" in action for action in statement.actions), statement
            if statement.resource == "*":
                # AWS has no resource to scope GetAuthorizationToken to.
                assert role == "ExecutionRole", statement
                assert statement.actions == {"ecr:GetAuthorizationToken"}, statement
                assert statement.condition == "ImageInEcr", statement


def test_the_task_role_names_every_resource() -> None:
    for statement in statements("TaskRole"):
        text = json.dumps(statement.resource)
        assert "*" not in text, statement
        # Built from what the operator named, never a literal ARN.
        assert references(statement.resource) & set(template()["Parameters"]), statement


@dataclass(frozen=True)
class Feature:
    condition: str | None  # None: always on
    actions: dict[str, set[str]]  # by what they act on: table, stream, queue
    switch: str | None  # the parameter that turns it on
    names: str  # the parameter that names what it acts on
    variable: str  # what tells the server


FEATURES: dict[str, Feature] = {
    "TablePolicy": Feature(
        None,
        {
            "table": {
                "dynamodb:DescribeTable",
                "dynamodb:GetItem",
                "dynamodb:Query",
                "dynamodb:BatchGetItem",
                "dynamodb:UpdateItem",
                "dynamodb:BatchWriteItem",
                "dynamodb:PartiQLUpdate",
            }
        },
        None,
        "TableName",
        "AP_TABLE",
    ),
    "NotificationsPolicy": Feature(
        "NotificationsOn",
        {
            "stream": {
                "dynamodb:DescribeStream",
                "dynamodb:GetShardIterator",
                "dynamodb:GetRecords",
            },
            "table": {"dynamodb:PutItem"},
        },
        "EnableNotifications",
        "TableStreamArn",
        "AP_NOTIFICATIONS_FROM_STREAM",
    ),
    "BroadcastQueuePolicy": Feature(
        "BroadcastBridgeOn",
        {"queue": {"sqs:ReceiveMessage", "sqs:DeleteMessage", "sqs:ChangeMessageVisibility"}},
        "BroadcastQueueUrl",
        "BroadcastQueueUrl",
        "AP_SQS_QUEUE_URL",
    ),
    "BotQueuePolicy": Feature(
        "BotBridgeOn",
        {
            "queue": {"sqs:ReceiveMessage", "sqs:DeleteMessage", "sqs:ChangeMessageVisibility"},
            "table": {"dynamodb:DeleteItem"},
        },
        "BotQueueUrl",
        "BotQueueUrl",
        "AP_BOT_QUEUE_URL",
    ),
    "BotForwardPolicy": Feature(
        "BotForwardOn",
        {"queue": {"sqs:SendMessage"}},
        "BotWebhookQueueUrl",
        "BotWebhookQueueUrl",
        "AP_BOT_WEBHOOK_QUEUE_URL",
    ),
}
"""Each policy of the task role, and the feature it belongs to."""


def _kind(statement: Statement) -> str:
    text = json.dumps(statement.resource)
    return "stream" if "/stream/" in text else "queue" if ":sqs:" in text else "table"


def test_each_feature_grants_its_own_actions_under_its_own_condition() -> None:
    granted = statements("TaskRole")
    assert {s.policy for s in granted} == set(FEATURES), "a policy no feature accounts for"
    env = environment()
    for policy, feature in FEATURES.items():
        mine = [s for s in granted if s.policy == policy]
        assert {s.condition for s in mine} == {feature.condition}, policy
        by_kind: dict[str, set[str]] = {}
        for statement in mine:
            by_kind.setdefault(_kind(statement), set()).update(statement.actions)
            assert feature.names in references(statement.resource) or _kind(statement) == "table"
        assert by_kind == feature.actions, policy
        # The server is told of the feature under exactly the same condition...
        assert env[feature.variable][0] == feature.condition, feature.variable
        if feature.condition is not None:
            # ...and the condition is the feature's own switch.
            assert feature.switch in _nested(feature.condition), policy
        else:
            assert feature.names in references(env[feature.variable][1])


def _nested(condition: str) -> set[str]:
    """Parameters a condition reads through the conditions it names."""
    node = template()["Conditions"][condition]
    names = references(node)
    for inner in re.findall(r'"Condition": "(\w+)"', json.dumps(node)):
        names |= references(template()["Conditions"][inner]) | _nested(inner)
    return names


# The DynamoDB calls of the store that only the stream reader makes (its fence and its
# checkpoints): permitted only with the notifications.
STREAM_STORE_FUNCTIONS = {"take_stream_fence", "stream_checkpoints", "save_stream_checkpoint"}
# The one the bot bridge's candidates need beyond every node's: their prune.
BOT_STORE_FUNCTIONS = {"drop_bot_candidate"}
# The `create-table` command, run once by whoever creates the table; never by `serve`.
NOT_SERVE = {"create_table"}


def _camel(operation: str) -> str:
    return "".join(part.capitalize() for part in operation.split("_"))


PARTIQL_ACTIONS = {"batch_execute_statement": "PartiQLUpdate"}
"""A PartiQL call is authorized by its statements' own actions, not its name: the
store's only ``BatchExecuteStatement`` sends UPDATEs (the ``lastSeen`` touches)."""


def _action(operation: str) -> str:
    return "dynamodb:" + PARTIQL_ACTIONS.get(operation, _camel(operation))


def _store_calls() -> dict[str, set[str]]:
    """DynamoDB operation -> the store functions that call it (server/store/dynamodb*.py)."""
    calls: dict[str, set[str]] = {}
    for path in sorted((ROOT / "server" / "store").glob("dynamodb*.py")):
        for function in ast.walk(ast.parse(path.read_text())):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(function):
                if not isinstance(node, ast.Call):
                    continue
                callee = node.func
                name = (
                    callee.attr if isinstance(callee, ast.Attribute) else getattr(callee, "id", "")
                )
                position = {"_call": 0, "call_with_retry": 1}.get(name)
                if position is None or len(node.args) <= position:
                    continue
                operation = node.args[position]
                if isinstance(operation, ast.Constant) and isinstance(operation.value, str):
                    calls.setdefault(operation.value, set()).add(function.name)
    return calls


def _client_calls(path: Path, client_attributes: set[str]) -> set[str]:
    """Operations called as ``self.<client>.<operation>(...)`` in one module."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Attribute)
            and node.func.value.attr in client_attributes
        ):
            found.add(node.func.attr)
    return found


def _actions(policy: str, kind: str) -> set[str]:
    return {
        action
        for statement in statements("TaskRole")
        if statement.policy == policy and _kind(statement) == kind
        for action in statement.actions
    }


def test_the_permissions_are_what_the_code_calls() -> None:
    calls = _store_calls()
    assert {"batch_write_item", "query", "update_item"} <= set(calls), "the scan found nothing"
    serve = {op: fns - NOT_SERVE for op, fns in calls.items() if fns - NOT_SERVE}
    special = STREAM_STORE_FUNCTIONS | BOT_STORE_FUNCTIONS
    core = {_action(op) for op, fns in serve.items() if fns - special}
    stream_only = {_action(op) for op, fns in serve.items() if fns & STREAM_STORE_FUNCTIONS}
    bot_only = {_action(op) for op, fns in serve.items() if fns & BOT_STORE_FUNCTIONS}
    assert _actions("TablePolicy", "table") == core
    assert _actions("NotificationsPolicy", "table") == stream_only - core == {"dynamodb:PutItem"}
    assert _actions("BotQueuePolicy", "table") == bot_only - core == {"dynamodb:DeleteItem"}

    ingress = ROOT / "server" / "ingress"
    reader_tables = _client_calls(ingress / "table_stream.py", {"_tables"})
    reader_streams = _client_calls(ingress / "table_stream.py", {"_streams"})
    assert {"dynamodb:" + _camel(op) for op in reader_tables} <= core
    assert {"dynamodb:" + _camel(op) for op in reader_streams} == _actions(
        "NotificationsPolicy", "stream"
    )

    # DeleteMessageBatch and ChangeMessageVisibilityBatch are authorized by the single actions.
    # Both bridges consume through the shared core; only the bot bridge sends.
    consume = _client_calls(ingress / "queue_core.py", {"_client"})
    consumed = {"sqs:" + _camel(op.removesuffix("_batch")) for op in consume}
    assert consumed == _actions("BroadcastQueuePolicy", "queue")
    assert consumed == _actions("BotQueuePolicy", "queue")
    assert not _client_calls(ingress / "sqs.py", {"_client"})
    forward = _client_calls(ingress / "bot_queue.py", {"_client"})
    assert {"sqs:" + _camel(op) for op in forward} == _actions("BotForwardPolicy", "queue")


def test_the_iam_table_of_deploy_md_says_what_the_template_grants() -> None:
    rows = {}
    for line in (ROOT / "docs" / "deploy.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[1].startswith("`--"):
            service = ""
            actions = set()
            for name in re.findall(r"`([\w:]+)`", cells[2]):
                service, _, action = name.rpartition(":") if ":" in name else (service, "", name)
                actions.add(f"{service}:{action}")
            rows[cells[1].strip("`")] = actions
    flags = {
        "TablePolicy": "--store dynamodb",
        "NotificationsPolicy": "--notifications-from-stream",
        "BroadcastQueuePolicy": "--sqs-queue-url",
        "BotQueuePolicy": "--bot-queue-url",
        "BotForwardPolicy": "--bot-webhook-queue-url",
    }
    for policy, flag in flags.items():
        assert rows[flag] == set().union(*FEATURES[policy].actions.values()), flag


def test_the_execution_role_reads_only_the_publish_secret_and_the_log_group() -> None:
    granted = statements("ExecutionRole")
    secret = [s for s in granted if s.resource == {"Ref": "PublishSecretArn"}]
    assert {(s.condition, s.actions) for s in secret} == {
        ("PublishSecretInSsm", frozenset({"ssm:GetParameters"})),
        ("!PublishSecretInSsm", frozenset({"secretsmanager:GetSecretValue"})),
    }
    logs = [s for s in granted if s.resource == {"Fn::GetAtt": ["LogGroup", "Arn"]}]
    assert [s.actions for s in logs] == [{"logs:CreateLogStream", "logs:PutLogEvents"}]
    assert container()["Secrets"] == [
        {"Name": "AP_PUBLISH_SECRET", "ValueFrom": {"Ref": "PublishSecretArn"}}
    ]
    assert "AP_PUBLISH_SECRET" not in environment()


# ------------------------------------------------------------- timing and ports


def _attribute(logical_id: str, key: str, attributes: str) -> str:
    pairs = {a["Key"]: a["Value"] for a in props(logical_id)[attributes]}
    return str(pairs[key])


def test_the_drain_fits_inside_the_deregistration_delay_and_the_stop_timeout() -> None:
    drain = float(literal("AP_DRAIN_SECONDS"))
    whole_drain = (
        drain
        + int(literal("AP_DRAIN_MOVE_GRACE_MS")) / 1000
        + 2 * int(literal("AP_PRESENCE_DEBOUNCE_MS")) / 1000
    )
    for group in ("PublicTargetGroup", "InternalTargetGroup"):
        delay = int(
            _attribute(group, "deregistration_delay.timeout_seconds", "TargetGroupAttributes")
        )
        assert delay > drain, group
        assert _attribute(group, "stickiness.enabled", "TargetGroupAttributes") == "false"
    assert container()["StopTimeout"] > whole_drain
    assert container()["StopTimeout"] <= 120, "Fargate's largest stop timeout"


def test_idle_sockets_outlive_the_balancer_idle_timeout_thanks_to_pings() -> None:
    idle = int(
        _attribute("PublicLoadBalancer", "idle_timeout.timeout_seconds", "LoadBalancerAttributes")
    )
    assert idle > float(literal("AP_PING_INTERVAL")) * 2


def test_wss_on_443_to_the_public_port_with_readiness_on_the_internal_one() -> None:
    listener = props("PublicListener")
    assert (listener["Protocol"], listener["Port"]) == ("HTTPS", 443)
    assert listener["Certificates"] == [{"CertificateArn": {"Ref": "CertificateArn"}}]
    assert listener["DefaultActions"] == [
        {"Type": "forward", "TargetGroupArn": {"Ref": "PublicTargetGroup"}}
    ]
    port, http_port = int(literal("AP_PORT")), int(literal("AP_HTTP_PORT"))
    public = props("PublicTargetGroup")
    assert (public["Port"], public["TargetType"]) == (port, "ip")
    assert (public["HealthCheckPath"], public["HealthCheckPort"]) == ("/readyz", str(http_port))
    internal = props("InternalTargetGroup")
    assert (internal["Port"], internal["HealthCheckPath"]) == (http_port, "/readyz")
    assert props("InternalLoadBalancer")["Scheme"] == "internal"
    assert (literal("AP_HOST"), literal("AP_HTTP_HOST")) == ("0.0.0.0", "0.0.0.0")
    liveness = " ".join(container()["HealthCheck"]["Command"])
    assert f"127.0.0.1:{http_port}/healthz" in liveness
    mappings = {m["ContainerPort"] for m in container()["PortMappings"]}
    assert mappings == {port, http_port}
    by_port = {
        lb["ContainerPort"]: lb["TargetGroupArn"] for lb in props("Service")["LoadBalancers"]
    }
    assert by_port == {
        port: {"Ref": "PublicTargetGroup"},
        http_port: {"Ref": "InternalTargetGroup"},
    }


def test_the_internal_port_is_reachable_only_from_inside_the_vpc() -> None:
    http_port = int(literal("AP_HTTP_PORT"))
    open_to_all = []
    for logical_id, group in resources("AWS::EC2::SecurityGroup").items():
        for rule in group["Properties"].get("SecurityGroupIngress", []):
            ports = range(rule["FromPort"], rule["ToPort"] + 1)
            if rule.get("CidrIp") == "0.0.0.0/0" or rule.get("CidrIpv6") == "::/0":
                open_to_all.append((logical_id, rule["FromPort"], rule["ToPort"]))
            if http_port in ports:
                assert rule.get("CidrIp") == {"Ref": "VpcCidr"}, (logical_id, rule)
    assert open_to_all == [("PublicLoadBalancerSecurityGroup", 443, 443)]
    task_rules = props("ServiceSecurityGroup")["SecurityGroupIngress"]
    assert {
        (r["FromPort"], json.dumps(r.get("SourceSecurityGroupId", r.get("CidrIp"))))
        for r in task_rules
    } == {
        (int(literal("AP_PORT")), json.dumps({"Ref": "PublicLoadBalancerSecurityGroup"})),
        (http_port, json.dumps({"Ref": "VpcCidr"})),
    }
    assert (
        props("Service")["NetworkConfiguration"]["AwsvpcConfiguration"]["AssignPublicIp"]
        == "DISABLED"
    )
    redis_rules = props("RedisSecurityGroup")["SecurityGroupIngress"]
    assert [r["SourceSecurityGroupId"] for r in redis_rules] == [{"Ref": "ServiceSecurityGroup"}]


def test_the_kernel_and_descriptor_limits_fit_the_settings() -> None:
    sysctls = {c["Namespace"]: int(c["Value"]) for c in container()["SystemControls"]}
    backlog = int(literal("AP_LISTEN_BACKLOG"))
    assert backlog <= sysctls["net.core.somaxconn"], "the kernel caps the backlog at somaxconn"
    assert backlog <= sysctls["net.ipv4.tcp_max_syn_backlog"]
    (nofile,) = [u for u in container()["Ulimits"] if u["Name"] == "nofile"]
    assert nofile["HardLimit"] > int(literal("AP_MAX_CONNECTIONS")) + 1000


# -------------------------------------------------------------------------- Redis


def test_redis_mode_picks_the_cluster_or_the_single_url() -> None:
    env = environment()
    assert env["AP_REDIS_CLUSTER_URL"][0] == "RedisClusterMode"
    assert env["AP_REDIS_URL"][0] == "!RedisClusterMode"
    assert "ConfigurationEndPoint" in json.dumps(env["AP_REDIS_CLUSTER_URL"][1])
    assert "PrimaryEndPoint" in json.dumps(env["AP_REDIS_URL"][1])
    group = props("Redis")
    assert group["NumNodeGroups"] == {
        "Fn::If": ["RedisClusterMode", {"Ref": "RedisShards"}, {"Ref": "AWS::NoValue"}]
    }
    assert group["NumCacheClusters"]["Fn::If"][0] == "RedisClusterMode"
    assert (group["AutomaticFailoverEnabled"], group["MultiAZEnabled"]) == (True, True)
    settings = props("RedisParameterGroup")["Properties"]
    assert settings["maxmemory-policy"] == "noeviction"
    assert settings["cluster-enabled"] == {"Fn::If": ["RedisClusterMode", "yes", "no"]}
    assert template()["Parameters"]["RedisMode"]["AllowedValues"] == ["primary-replica", "cluster"]


# ---------------------------------------------------------------- the rest


def test_every_variable_is_a_server_setting() -> None:
    known = {"AP_" + name.upper() for name in Settings.__dataclass_fields__}
    named = set(environment()) | {s["Name"] for s in container()["Secrets"]}
    assert named <= known, named - known
    assert literal("AP_STORE") == "dynamodb"


def test_autoscaling_on_cpu_logs_and_outputs() -> None:
    target = props("ScalableTarget")
    assert {"Cluster", "Service"} <= references(target["ResourceId"])
    assert target["ScalableDimension"] == "ecs:service:DesiredCount"
    tracking = props("CpuScalingPolicy")["TargetTrackingScalingPolicyConfiguration"]
    assert tracking["PredefinedMetricSpecification"]["PredefinedMetricType"] == (
        "ECSServiceAverageCPUUtilization"
    )
    assert tracking["ScaleInCooldown"] > tracking["ScaleOutCooldown"]
    logging = container()["LogConfiguration"]
    assert (logging["LogDriver"], logging["Options"]["awslogs-group"]) == (
        "awslogs",
        {"Ref": "LogGroup"},
    )
    outputs = template()["Outputs"]
    assert outputs["WebSocketUrl"]["Value"] == {"Fn::Sub": "wss://${DomainName}/"}
    assert outputs["PublishUrl"]["Value"] == {
        "Fn::Sub": "http://${InternalLoadBalancer.DNSName}:" + literal("AP_HTTP_PORT") + "/publish"
    }


# --------------------------------------------------------------------------- moto

MOTO_UNSUPPORTED = {
    "AWS::ElastiCache::SubnetGroup",
    "AWS::ElastiCache::ParameterGroup",
    "AWS::ElastiCache::ReplicationGroup",
    "AWS::ApplicationAutoScaling::ScalableTarget",
    "AWS::ApplicationAutoScaling::ScalingPolicy",
}
"""Resource types moto's CloudFormation cannot create: dropped from the stack sent to moto
(checked above on the parsed template only). What named them gets a stand-in value."""

ACCOUNT = "123456789012"  # moto's default account
REGION = "us-east-1"
TABLE = "abstract-play-deploy-test"


def _for_moto() -> tuple[dict[str, Any], set[str]]:
    tpl = template()
    dropped = {k for k, v in tpl["Resources"].items() if v["Type"] in MOTO_UNSUPPORTED}
    assert dropped == {
        "RedisSubnetGroup",
        "RedisParameterGroup",
        "Redis",
        "ScalableTarget",
        "CpuScalingPolicy",
    }
    for logical_id in dropped:
        del tpl["Resources"][logical_id]

    def stand_in(attribute: str) -> str:
        return "6379" if attribute.endswith("Port") else "redis.dropped-for-moto.invalid"

    def scrub(node: Node) -> Node:
        if isinstance(node, dict):
            got = node.get("Fn::GetAtt")
            if got is not None and got[0] in dropped:
                return stand_in(got[1])
            if node.get("Ref") in dropped:
                return "dropped-for-moto"
            return {key: scrub(value) for key, value in node.items()}
        if isinstance(node, list):
            return [scrub(item) for item in node]
        if isinstance(node, str):
            pattern = r"\$\{(" + "|".join(sorted(dropped)) + r")\.([A-Za-z.]+)\}"
            return re.sub(pattern, lambda m: stand_in(m.group(2)), node)
        return node

    scrubbed: dict[str, Any] = scrub(tpl)
    return scrubbed, dropped


@pytest.fixture(scope="module")
def aws(dynamodb_endpoint: str) -> dict[str, str]:
    """boto3 client arguments for the session's moto server (it answers every service)."""
    return {"endpoint_url": dynamodb_endpoint, "region_name": REGION}


def _queue_url(name: str) -> str:
    return f"https://sqs.{REGION}.amazonaws.com/{ACCOUNT}/{name}"


def _parameters(aws: dict[str, str], every_feature: bool) -> dict[str, str]:
    suffix = uuid.uuid4().hex[:8]
    ec2 = boto3.client("ec2", **aws)
    vpc = ec2.create_vpc(CidrBlock="10.40.0.0/16")["Vpc"]["VpcId"]
    subnets = [
        ec2.create_subnet(VpcId=vpc, CidrBlock=f"10.40.{i}.0/24", AvailabilityZone=REGION + zone)[
            "Subnet"
        ]["SubnetId"]
        for i, zone in enumerate("abab")
    ]
    domain = f"ws-{suffix}.example.test"
    certificate = boto3.client("acm", **aws).request_certificate(DomainName=domain)
    parameters = {
        "ContainerImage": "ap-realtime:test",
        "VpcId": vpc,
        "VpcCidr": "10.40.0.0/16",
        "PublicSubnetIds": ",".join(subnets[:2]),
        "PrivateSubnetIds": ",".join(subnets[2:]),
        "CertificateArn": certificate["CertificateArn"],
        "DomainName": domain,
        "TableName": TABLE,
        "CognitoUserPoolId": "us-east-1_TestPool1",
        "CognitoClientId": "testclient123",
    }
    if every_feature:
        table_arn = f"arn:aws:dynamodb:{REGION}:{ACCOUNT}:table/{TABLE}"
        name = f"/ap-realtime/{suffix}/publish"
        ssm = boto3.client("ssm", **aws)
        ssm.put_parameter(Name=name, Value="p" * 40, Type="SecureString")
        zone = boto3.client("route53", **aws).create_hosted_zone(
            Name="example.test", CallerReference=suffix
        )
        parameters |= {
            "PublishSecretArn": ssm.get_parameter(Name=name)["Parameter"]["ARN"],
            "EcrRepositoryArn": f"arn:aws:ecr:{REGION}:{ACCOUNT}:repository/ap-realtime",
            "HostedZoneId": zone["HostedZone"]["Id"].split("/")[-1],
            "EnableNotifications": "true",
            "TableStreamArn": f"{table_arn}/stream/2026-01-01T00:00:00.000",
            "BroadcastQueueUrl": _queue_url("abstractplay-ws-messages-test"),
            "BotQueueUrl": _queue_url("bots-out-test"),
            "BotWebhookQueueUrl": _queue_url("bots-forward-test"),
            "BotChallengesByWebhook": "true",
            "BotUserPoolId": "us-east-1_BotPool22",
            "BotScope": "resource-server/communicate",
            "RedisMode": "cluster",
        }
    else:
        secret = boto3.client("secretsmanager", **aws).create_secret(
            Name=f"ap-realtime-{suffix}", SecretString="s" * 40
        )
        parameters["PublishSecretArn"] = secret["ARN"]
    return parameters


def _create(
    aws: dict[str, str], parameters: dict[str, str]
) -> tuple[dict[str, Any], dict[str, str]]:
    body, _dropped = _for_moto()
    cloudformation = boto3.client("cloudformation", **aws)
    name = f"ap-realtime-{uuid.uuid4().hex[:10]}"
    cloudformation.create_stack(
        StackName=name,
        TemplateBody=json.dumps(body),
        Parameters=[{"ParameterKey": k, "ParameterValue": v} for k, v in parameters.items()],
        Capabilities=["CAPABILITY_IAM"],
    )
    deadline = time.monotonic() + 120
    while True:
        (stack,) = cloudformation.describe_stacks(StackName=name)["Stacks"]
        if not stack["StackStatus"].endswith("_IN_PROGRESS") or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert stack["StackStatus"] == "CREATE_COMPLETE", stack.get("StackStatusReason")
    physical = {
        r["LogicalResourceId"]: r["PhysicalResourceId"]
        for r in cloudformation.describe_stack_resources(StackName=name)["StackResources"]
        if "LogicalResourceId" in r
    }
    return stack, physical


def _role_policies(iam: Any, role: str) -> dict[str, list[dict[str, Any]]]:
    documents = {}
    for policy in iam.list_role_policies(RoleName=role)["PolicyNames"]:
        document = iam.get_role_policy(RoleName=role, PolicyName=policy)["PolicyDocument"]
        if isinstance(document, str):
            # moto keeps a role's inline Policies (not AWS::IAM::Policy) as a Python repr.
            document = ast.literal_eval(document)
        documents[policy] = document["Statement"]
    return documents


def _granted(statements: list[dict[str, Any]]) -> set[tuple[str, str]]:
    pairs = set()
    for statement in statements:
        actions = statement["Action"]
        for action in [actions] if isinstance(actions, str) else actions:
            pairs.add((action, statement["Resource"]))
    return pairs


@pytest.mark.parametrize("every_feature", [True, False], ids=["every-feature", "no-feature"])
def test_stack_in_moto(aws: dict[str, str], every_feature: bool) -> None:
    """Create the stack and read back, through each service's API, what moto keeps.

    Read back here: the IAM roles' policies (names, actions, resolved ARNs), the task
    definition's container (every AP_* variable, loaded by the server's own config; the
    secret; stop timeout; nofile; sysctls; log group), the target groups' ports and health
    checks, the HTTPS listener and its certificate, the security groups' rules, the log
    group's retention, the DNS record, and the outputs. moto keeps but ignores the balancer
    and target group attributes (idle timeout, deregistration delay) and the service's
    network and balancer settings: the parsed-template tests above check those.
    """
    parameters = _parameters(aws, every_feature)
    stack, physical = _create(aws, parameters)
    table_arn = f"arn:aws:dynamodb:{REGION}:{ACCOUNT}:table/{TABLE}"

    iam = boto3.client("iam", **aws)
    task = _role_policies(iam, physical["TaskRole"])
    core = {(action, table_arn) for action in FEATURES["TablePolicy"].actions["table"]}
    if every_feature:
        queue_actions = FEATURES["BroadcastQueuePolicy"].actions["queue"]

        def queue(url: str) -> str:
            return f"arn:aws:sqs:{REGION}:{ACCOUNT}:{url.rsplit('/', 1)[1]}"

        assert {name: _granted(doc) for name, doc in task.items()} == {
            "table": core,
            "notifications": {
                (a, parameters["TableStreamArn"])
                for a in FEATURES["NotificationsPolicy"].actions["stream"]
            }
            | {("dynamodb:PutItem", table_arn)},
            "broadcast-queue": {(a, queue(parameters["BroadcastQueueUrl"])) for a in queue_actions},
            "bot-queue": {(a, queue(parameters["BotQueueUrl"])) for a in queue_actions}
            | {("dynamodb:DeleteItem", table_arn)},
            "bot-forward-queue": {("sqs:SendMessage", queue(parameters["BotWebhookQueueUrl"]))},
        }
    else:
        assert {name: _granted(doc) for name, doc in task.items()} == {"table": core}

    execution = set().union(
        *(_granted(doc) for doc in _role_policies(iam, physical["ExecutionRole"]).values())
    )
    secret_action = "ssm:GetParameters" if every_feature else "secretsmanager:GetSecretValue"
    assert (secret_action, parameters["PublishSecretArn"]) in execution
    assert (("ecr:GetAuthorizationToken", "*") in execution) == every_feature
    assert not any("*" in action for action, _ in execution)

    ecs = boto3.client("ecs", **aws)
    definition = ecs.describe_task_definition(taskDefinition=physical["TaskDefinition"])
    (box,) = definition["taskDefinition"]["containerDefinitions"]
    # moto leaves an AWS::NoValue in a list as a null element: skip those.
    env = {pair["name"]: pair["value"] for pair in box["environment"] if pair}
    assert box["secrets"] == [
        {"name": "AP_PUBLISH_SECRET", "valueFrom": parameters["PublishSecretArn"]}
    ]
    settings = load(None, env | {"AP_PUBLISH_SECRET": "from-the-secret-store"})
    assert (settings.store, settings.table, settings.region) == ("dynamodb", TABLE, REGION)
    assert settings.cognito_issuer == (
        f"https://cognito-idp.us-east-1.amazonaws.com/{parameters['CognitoUserPoolId']}"
    )
    assert (settings.host, settings.port, settings.http_port) == ("0.0.0.0", 8765, 8766)
    feature_variables = {
        "AP_NOTIFICATIONS_FROM_STREAM",
        "AP_SQS_QUEUE_URL",
        "AP_BOT_QUEUE_URL",
        "AP_BOT_WEBHOOK_QUEUE_URL",
        "AP_BOT_CHALLENGES_BY_WEBHOOK",
    }
    if every_feature:
        assert settings.redis_cluster_url == "redis://redis.dropped-for-moto.invalid:6379"
        assert settings.redis_url is None
        assert settings.notifications_from_stream
        assert settings.sqs_queue_url == parameters["BroadcastQueueUrl"]
        assert settings.bot_cognito_issuer == (
            "https://cognito-idp.us-east-1.amazonaws.com/us-east-1_BotPool22"
        )
        assert settings.bot_scope == parameters["BotScope"]
        assert settings.bot_queue_url == parameters["BotQueueUrl"]
        assert settings.bot_webhook_queue_url == parameters["BotWebhookQueueUrl"]
        assert settings.bot_challenges_by_webhook
    else:
        assert settings.redis_url == "redis://redis.dropped-for-moto.invalid:6379/0"
        assert settings.redis_cluster_url is None
        assert not settings.notifications_from_stream and settings.sqs_queue_url is None
        assert settings.bot_cognito_issuer is None
        assert settings.bot_queue_url is None and settings.bot_webhook_queue_url is None
        assert not settings.bot_challenges_by_webhook
        assert not feature_variables & set(env)
    drain = settings.drain_seconds + settings.drain_move_grace_ms / 1000
    assert box["stopTimeout"] > drain + 2 * settings.presence_debounce
    assert {"name": "nofile", "softLimit": 65536, "hardLimit": 65536} in box["ulimits"]
    sysctls = {c["namespace"]: int(c["value"]) for c in box["systemControls"]}
    assert settings.listen_backlog <= sysctls["net.core.somaxconn"]
    assert box["logConfiguration"]["options"]["awslogs-group"] == physical["LogGroup"]

    logs = boto3.client("logs", **aws)
    (group,) = logs.describe_log_groups(logGroupNamePrefix=physical["LogGroup"])["logGroups"]
    assert group["retentionInDays"] == 30

    elb = boto3.client("elbv2", **aws)
    (public,) = elb.describe_target_groups(TargetGroupArns=[physical["PublicTargetGroup"]])[
        "TargetGroups"
    ]
    assert (public["Port"], public["HealthCheckPort"], public["HealthCheckPath"]) == (
        settings.port,
        str(settings.http_port),
        "/readyz",
    )
    (internal,) = elb.describe_target_groups(TargetGroupArns=[physical["InternalTargetGroup"]])[
        "TargetGroups"
    ]
    assert (internal["Port"], internal["HealthCheckPath"]) == (settings.http_port, "/readyz")
    (listener,) = elb.describe_listeners(ListenerArns=[physical["PublicListener"]])["Listeners"]
    assert (listener["Protocol"], listener["Port"]) == ("HTTPS", 443)
    assert listener["Certificates"] == [{"CertificateArn": parameters["CertificateArn"]}]

    ec2 = boto3.client("ec2", **aws)
    (tasks_group,) = ec2.describe_security_groups(GroupIds=[physical["ServiceSecurityGroup"]])[
        "SecurityGroups"
    ]
    rules = {
        rule["FromPort"]: (
            [r["CidrIp"] for r in rule["IpRanges"]],
            [p["GroupId"] for p in rule["UserIdGroupPairs"]],
        )
        for rule in tasks_group["IpPermissions"]
    }
    assert rules == {
        settings.port: ([], [physical["PublicLoadBalancerSecurityGroup"]]),
        settings.http_port: ([parameters["VpcCidr"]], []),
    }

    outputs = {o["OutputKey"]: o["OutputValue"] for o in stack["Outputs"]}
    assert outputs["WebSocketUrl"] == f"wss://{parameters['DomainName']}/"
    (internal_lb,) = elb.describe_load_balancers(
        LoadBalancerArns=[physical["InternalLoadBalancer"]]
    )["LoadBalancers"]
    assert internal_lb["Scheme"] == "internal"
    assert outputs["PublishUrl"] == f"http://{internal_lb['DNSName']}:8766/publish"

    if every_feature:
        records = boto3.client("route53", **aws).list_resource_record_sets(
            HostedZoneId=parameters["HostedZoneId"]
        )["ResourceRecordSets"]
        assert any(r["Name"].rstrip(".") == parameters["DomainName"] for r in records)
    else:
        assert "DnsRecord" not in physical and "NotificationsPolicy" not in physical
