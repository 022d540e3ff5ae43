"""Tokens and text: the role-tagged chat-template rendering (template.py), the tool-call protocol
and its parser (toolcall.py), and a task's gold trajectory as the model sees it (gold.py)."""
