"""Eviction / placement policies, looked up by name. See base.py for the interface."""

from dflash2.policy.base import Policy, make_policy, policy_names, register

__all__ = ["Policy", "make_policy", "policy_names", "register"]
