"""services.engine"""
