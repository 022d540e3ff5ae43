"""The `mcp` suite: any MCP server (stdio) and a task file as an environment, called for real or
rehearsed (docs/envs.md "mcp"). Imports the `mcp` SDK only when a server starts."""
from fastrehearse.envs.mcptools.client import CallOutcome, Server, ServerStartError
from fastrehearse.envs.mcptools.suite import ISOLATIONS, McpEnv, McpSuite

__all__ = ["McpSuite", "McpEnv", "Server", "ServerStartError", "CallOutcome", "ISOLATIONS"]
