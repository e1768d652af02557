"""Shared by every role: wire protocol, transport, layout math, config, errors.

Nothing here imports a role package.
"""
