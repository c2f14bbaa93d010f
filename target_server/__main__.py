from specdec.engine import TargetEngine
from specdec.serving.server import main
from target_server.servicer import SERVICE_NAME, add_to_server

if __name__ == "__main__":
    main("target", TargetEngine, add_to_server, SERVICE_NAME)
