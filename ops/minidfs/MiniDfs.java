// A MiniDFSCluster (NameNode and DataNodes in one JVM, Hadoop's own
// test cluster from Maven Central's hadoop-client-minicluster) for the
// HDFS tests; started by ops/test.
//
// Usage: java -cp CLASSPATH MiniDfs.java BASE_DIR [DATANODES]
// DATANODES: how many DataNodes (default 1; new files get one replica).
// Binds to 127.0.0.1 on free ports, keeps its data under BASE_DIR, prints
// "hdfs://127.0.0.1:PORT" (the NameNode) and, on the next line,
// "http://127.0.0.1:PORT" (its HTTP server, for WebHDFS) once the cluster
// is up, and shuts down when its standard input closes.
package ferry;

import java.io.InputStream;

import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.hdfs.HdfsConfiguration;
import org.apache.hadoop.hdfs.MiniDFSCluster;

public class MiniDfs {
    public static void main(String[] args) throws Exception {
        if (args.length < 1 || args.length > 2) {
            System.err.println("usage: MiniDfs BASE_DIR [DATANODES]");
            System.exit(2);
        }
        int dataNodes = args.length == 2 ? Integer.parseInt(args[1]) : 1;
        Configuration conf = new HdfsConfiguration();
        conf.set(MiniDFSCluster.HDFS_MINIDFS_BASEDIR, args[0]);
        conf.set("dfs.replication", "1");
        conf.set("dfs.namenode.rpc-bind-host", "127.0.0.1");
        conf.set("dfs.namenode.http-address", "127.0.0.1:0");
        conf.set("dfs.namenode.secondary.http-address", "127.0.0.1:0");
        conf.set("dfs.datanode.address", "127.0.0.1:0");
        conf.set("dfs.datanode.http.address", "127.0.0.1:0");
        conf.set("dfs.datanode.ipc.address", "127.0.0.1:0");
        MiniDFSCluster cluster = new MiniDFSCluster.Builder(conf)
            .nameNodePort(0)
            .numDataNodes(dataNodes)
            .format(true)
            .build();
        cluster.waitActive();
        // Both lines in one write: readers wait for the file to be non-empty.
        System.out.print("hdfs://127.0.0.1:" + cluster.getNameNodePort() + "\n"
            + "http://127.0.0.1:" + cluster.getNameNode().getHttpAddress().getPort() + "\n");
        System.out.flush();
        InputStream in = System.in;
        byte[] buf = new byte[256];
        while (in.read(buf) >= 0) {
            // Runs until standard input closes.
        }
        cluster.shutdown();
        System.exit(0);
    }
}
