"""The operator console: read-only HTML pages, beside the API (docs/console.md).

Server-rendered with Jinja2 templates (autoescaped), no JavaScript at all (the
pages' Content-Security-Policy forbids scripts), behind one operator token
(OPERATOR_TOKEN; without it the console answers 404 "disabled"). It reads
through app/readmodel and asks the PSP and the rail through the same probe
calls a resumer makes (app/rails/gateways.py), never holding a database
connection while it waits for them. It writes nothing, anywhere.
"""
