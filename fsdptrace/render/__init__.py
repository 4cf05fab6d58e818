"""Renderers: findings and traces to text, JSON, Markdown, Chrome traces and HTML.

Each renderer writes to a stream it is given; none computes findings itself.
"""
