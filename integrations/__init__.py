"""Adapters from FreeToken models to agent frameworks.

Import-light on purpose: each adapter is a subpackage imported on demand, e.g.
`from freetoken_agents.integrations.langchain import ChatFreeToken`.
"""
