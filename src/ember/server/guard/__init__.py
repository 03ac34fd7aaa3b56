"""What a client may do and hold: memory budgets (``memory``), per-client limits and admission
(``limits``) and who may open a session (``auth``). It imports nothing else of the server."""
