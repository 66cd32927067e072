"""The live dashboard: a web page and its JSON API over the server's own objects
(`serve --http-listen HOST:PORT`). Standard library only; the page's script and style are
package data under ``static/``."""

from .web import Dashboard

__all__ = ["Dashboard"]
