"""storage_node"""
