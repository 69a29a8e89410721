"""Conversations: messages fitted to the context window (:mod:`.conversation`), chats saved as
they go (:mod:`.saved`), and the REPL behind ``adaptive-llama run`` (:mod:`.repl`).

Nothing is imported here: saved chats load without llama.cpp; ``adaptive_llama`` re-exports
:class:`~.conversation.Chat`.
"""
