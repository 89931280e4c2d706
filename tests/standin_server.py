"""Stands in for the vLLM server in SLURM launch tests only: answers GET /health with 200 until terminated."""

import argparse
import http.server


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path.rstrip("/") == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    options = parser.parse_args()
    http.server.ThreadingHTTPServer((options.host, options.port), Health).serve_forever()
