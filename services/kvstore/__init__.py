"""services.kvstore"""
