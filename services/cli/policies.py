"""Register policy servers with the evaluation API, and list the registered policies.

`register` gives the API a running policy server's WebSocket URL; the API reads its
handshake (checkpoint, dimensions, tasks). Registering the same checkpoint again
under the same name and version is harmless. `add-endpoint` and `remove-endpoint`
add and remove replicas: more servers of the same checkpoint, which workers spread
episodes over and fail over between (`--replica` at registration does the same).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from services.cli.connection import add_connection_options, add_json_option, client_verb

if TYPE_CHECKING:
    from services.client import EvalForgeClient
    from services.eval_api.schemas import PolicyOut


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    register_parser = actions.add_parser("register",
                                         help="register a running policy server (the API reads its handshake)")
    register_parser.add_argument("--name", required=True, help="policy name, e.g. metaworld-mt10-bc")
    register_parser.add_argument("--endpoint", required=True, metavar="URL",
                                 help="the policy server's WebSocket URL, e.g. ws://gpu-3:8000/ws")
    register_parser.add_argument("--version",
                                 help="version label (default: the checkpoint sha256's first 12 digits)")
    register_parser.add_argument("--replica", action="append", metavar="URL", default=[],
                                 help="another server of the same checkpoint (repeatable)")
    register_parser.set_defaults(action_run=client_verb(register))
    add_parser = actions.add_parser("add-endpoint", help="add a replica: another server of the policy's checkpoint")
    remove_parser = actions.add_parser("remove-endpoint", help="remove a replica of a policy")
    for endpoint_parser, verb in ((add_parser, add_endpoint), (remove_parser, remove_endpoint)):
        endpoint_parser.add_argument("policy", metavar="POLICY", help="policy id, NAME or NAME:VERSION")
        endpoint_parser.add_argument("endpoint", metavar="URL", help="the replica's WebSocket URL, e.g. "
                                     "ws://gpu-4:8000/ws")
        endpoint_parser.set_defaults(action_run=client_verb(verb))
    list_parser = actions.add_parser("list", help="registered policies, newest first")
    list_parser.set_defaults(action_run=client_verb(list_policies))
    for action_parser in (register_parser, list_parser, add_parser, remove_parser):
        add_connection_options(action_parser)
        add_json_option(action_parser)


def run(args: argparse.Namespace) -> int:
    return args.action_run(args)


def register(args: argparse.Namespace, client: EvalForgeClient) -> int:
    from services.cli.render import print_json

    policy = client.register_policy(args.name, args.endpoint, args.version, replicas=args.replica)
    if args.json:
        print_json(policy)
        return 0
    replicas = f" (+{len(policy.endpoints) - 1} replicas)" if len(policy.endpoints) > 1 else ""
    print(f"policy {policy.id}: {policy.label} (checkpoint {policy.checkpoint_sha256[:12]}…) at "
          f"{policy.endpoint}{replicas}, {len(policy.tasks)} tasks; evaluate it with `evalforge eval submit "
          f"--policy {policy.id} --suite SUITE --episodes-per-task N`")
    return 0


def add_endpoint(args: argparse.Namespace, client: EvalForgeClient) -> int:
    return _print_endpoints(args, client.add_policy_endpoint(client.resolve_policy(args.policy).id, args.endpoint))


def remove_endpoint(args: argparse.Namespace, client: EvalForgeClient) -> int:
    return _print_endpoints(args, client.remove_policy_endpoint(client.resolve_policy(args.policy).id,
                                                                args.endpoint))


def _print_endpoints(args: argparse.Namespace, policy: PolicyOut) -> int:
    from services.cli.render import print_json

    if args.json:
        print_json(policy)
        return 0
    print(f"policy {policy.id}: {policy.label} is served at {len(policy.endpoints)} endpoint(s):")
    for endpoint in policy.endpoints:
        print(f"  {endpoint}")
    return 0


def list_policies(args: argparse.Namespace, client: EvalForgeClient) -> int:
    from services.cli.render import print_json, print_policies, stdout_console

    policies = client.list_policies()
    if args.json:
        print_json(policies)
        return 0
    if not policies:
        print("no policies registered; register a policy server with `evalforge policy register --name NAME "
              "--endpoint ws://HOST:PORT/ws`")
        return 0
    print_policies(policies, stdout_console())
    return 0
