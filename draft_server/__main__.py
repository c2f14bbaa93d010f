from draft_server.servicer import SERVICE_NAME, add_to_server
from specdec.engine import DraftEngine
from specdec.serving.server import main

if __name__ == "__main__":
    main("draft", DraftEngine, add_to_server, SERVICE_NAME)
